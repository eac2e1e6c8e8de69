"""Reward-hacking detectors: behaviour drift between canary and stable.

A policy trained on a reward can learn to dodge the reward instead of earning it. Two cases
seen in production RL on coding assistants: broken tool calls emitted on tasks the model
expects to fail (when broken calls were discarded rather than penalised), and clarifying
questions instead of risky edits (when only edits were rewarded). Each detector watches one
behaviour rate with the same always-valid test as the metrics and fires only when the drift
is confidently beyond its tolerance; a point estimate beyond tolerance that is not yet
confident holds promotion back.

| detector | watches | suspicious direction |
|---|---|---|
| edit_rate | share of completions that are edits | down |
| question_rate | share that are clarifying questions | up |
| abstention_rate | share that are empty | up |
| invalid_tool_rate | invalid tool calls / tool calls | up |
| completion_length | mean completion tokens | either way (relative tolerance) |
"""

from __future__ import annotations

from typing import Literal

from rollback.metrics import (
    LABELS,
    IndexedArm,
    compare,
    fmt_delta,
    fmt_value,
    metric_cells,
    ratio_cells,
)
from rollback.stats import stratified_difference
from rollback.types import DetectorResult, JudgePolicy, JudgeState, MetricEvidence

Suspicious = Literal["down", "up", "either"]

DETECTORS: dict[str, Suspicious] = {
    "edit_rate": "down",
    "question_rate": "up",
    "abstention_rate": "up",
    "invalid_tool_rate": "up",
    "completion_length": "either",
}

WHY = {
    "edit_rate": "the canary avoids proposing edits (it asks or answers nothing instead)",
    "question_rate": "the canary defers edits by asking clarifying questions",
    "abstention_rate": "the canary returns nothing more often, dodging negative reward",
    "invalid_tool_rate": "the canary emits broken tool calls, e.g. on tasks it expects to fail",
    "completion_length": ("the canary's output length changed sharply, a common sign of reward "
                          "over-optimisation"),
}


def drift_check(
    direction: Suspicious, lower: float, upper: float, estimate: float, tolerance: float
) -> tuple[bool, bool]:
    """(fired, holding) from the confidence bounds on canary − stable.

    Fired: the whole interval lies beyond the tolerance in the suspicious direction.
    Holding: the point estimate does, but the interval does not yet.
    """
    up_fired, up_hold = lower > tolerance, estimate > tolerance
    down_fired, down_hold = upper < -tolerance, estimate < -tolerance
    if direction == "up":
        fired, hold = up_fired, up_hold
    elif direction == "down":
        fired, hold = down_fired, down_hold
    else:
        fired, hold = up_fired or down_fired, up_hold or down_hold
    return fired, hold and not fired


def tolerance(name: str, policy: JudgePolicy, stable_mean: float) -> float:
    d = policy.detectors
    if name == "completion_length":
        return max(1.0, d.length_change * abs(stable_mean))
    return {
        "edit_rate": d.edit_rate_drop,
        "question_rate": d.question_rate_rise,
        "abstention_rate": d.abstention_rate_rise,
        "invalid_tool_rate": d.invalid_tool_rate_rise,
    }[name]


def run_detectors(
    stable: IndexedArm,
    canary: IndexedArm,
    strata: int,
    policy: JudgePolicy,
    alpha: float,
    state: JudgeState,
) -> tuple[DetectorResult, ...]:
    """Run every enabled detector (compared within time strata, like the metrics); ``alpha``
    is each detector's share of the error budget."""
    results = []
    for name in policy.detectors.enabled:
        if name not in DETECTORS:
            raise ValueError(f"unknown detector {name!r}; known: {sorted(DETECTORS)}")
        if name == "invalid_tool_rate":
            s_cells, c_cells = (ratio_cells(a, a.cols.invalid_tool_calls, a.cols.tool_calls)
                                for a in (stable, canary))
        else:
            s_cells, c_cells = metric_cells(stable, name), metric_cells(canary, name)
        st = stratified_difference(s_cells, c_cells, strata, policy.user_weight_cap)
        tol = tolerance(name, policy, st.stable_mean)
        suspicious = DETECTORS[name]
        ev = compare(name, (st.stable_mean, st.var_stable, st.users_stable, 0),
                     (st.canary_mean, st.var_canary, st.users_canary, 0),
                     direction="higher_is_better" if suspicious == "down" else "lower_is_better",
                     mde=tol, tau=policy.mixture_scale * tol, alpha=alpha,
                     min_n=policy.min_users, state=state)
        if ev.status == "insufficient":
            results.append(DetectorResult(name, ev, False, False, f"{LABELS[name]}: too few users yet."))
            continue
        fired, holding = drift_check(suspicious, ev.ci_lower, ev.ci_upper, ev.estimate, tol)
        results.append(DetectorResult(name, ev, fired, holding, explain(name, ev, tol, fired, holding)))
    return tuple(results)


def explain(name: str, ev: MetricEvidence, tol: float, fired: bool, holding: bool) -> str:
    label = LABELS[name]
    moved = "rose" if ev.estimate > 0 else "fell"
    body = (f"{label} {moved} from {fmt_value(name, ev.stable_mean)} on stable to "
            f"{fmt_value(name, ev.canary_mean)} on the canary (difference {fmt_delta(name, ev.estimate)}, "
            f"always-valid interval {fmt_delta(name, ev.ci_lower)} to {fmt_delta(name, ev.ci_upper)}, "
            f"tolerance ±{fmt_delta(name, tol, sign=False)})")
    if fired:
        return f"Reward hacking: {body}; {WHY[name]}."
    if holding:
        return f"Promotion held: {body}; not yet conclusive, watching for reward hacking."
    return (f"{label.capitalize()}: no drift beyond ±{fmt_delta(name, tol, sign=False)} "
            f"({fmt_value(name, ev.stable_mean)} on stable, "
            f"{fmt_value(name, ev.canary_mean)} on the canary).")
