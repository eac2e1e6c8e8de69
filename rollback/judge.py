"""The rollback judge: one pure call per tick, ``judge(stable, canary, policy, state)``.

Order of precedence in a verdict:
1. a guardrail tripped (error rate or p99 latency over its ceiling) -> rollback, at once;
2. a metric is confidently worse on the canary (its always-valid confidence sequence on
   canary − stable excludes 0 in the bad direction; from ``rollback_min_users`` users per
   arm, each arm's variance floored by the larger per-user variance until ``min_users``)
   -> rollback;
3. a reward-hacking detector found confident behaviour drift -> rollback;
4. every primary metric is confidently no worse than −MDE (non-inferior), no detector is
   holding, each arm has at least ``min_users`` users -> promote;
5. the sample or time budget is spent -> inconclusive (abort, never promote);
6. otherwise -> continue.
See docs/judge.md for the method and how to tune it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from rollback.columns import SESSION_RATIOS
from rollback.detectors import run_detectors
from rollback.metrics import (
    CONTINUOUS,
    LABELS,
    METRICS,
    IndexedArm,
    capped_cells,
    cells_of,
    columns_of,
    compare_cells,
    error_cells,
    fmt_delta,
    fmt_duration,
    fmt_value,
    index_arms,
    metric_cells,
    session_cells,
)
from rollback.stats import (
    Cells,
    design_effect,
    exceedance_log_lr,
    quantile,
    ratio_mean_var,
    stratified_difference,
)
from rollback.types import (
    CohortData,
    Decision,
    GuardrailResult,
    JudgePolicy,
    JudgeState,
    MetricEvidence,
    MetricSpec,
    Verdict,
)


def judge(
    stable: CohortData,
    canary: CohortData,
    policy: JudgePolicy | None = None,
    state: JudgeState | None = None,
    *,
    elapsed_s: float = 0.0,
    boundaries: Sequence[float] = (),
) -> Verdict:
    """Judge the canary against stable over the same window.

    ``state`` is the ``Verdict.state`` of the previous tick (None on the first); ``elapsed_s``
    is the time since the canary started, for the time budget; ``boundaries`` are the times the
    canary's weight changed, its start first (each starts a new time stratum).
    """
    policy = policy or JudgePolicy()
    stable, canary = _with_columns(stable), _with_columns(canary)
    st: JudgeState = dict(state or {})
    st["ticks"] = st.get("ticks", 0.0) + 1.0
    users_s, users_c = stable.users(), canary.users()

    alpha_t = policy.alpha_per_test()
    arm_s, arm_c, strata = index_arms(stable, canary, boundaries, policy.stratum_s)
    arms = (arm_s, arm_c)
    guards = guardrails(stable, canary, policy, arms, strata)
    evidence = tuple(_metric(spec, stable, canary, arms, strata, policy, alpha_t, st)
                     for spec in policy.metrics)
    detectors = run_detectors(arm_s, arm_c, strata, policy, alpha_t, st)

    reasons: list[str] = []
    level = 1.0 - 2.0 * alpha_t
    tripped = [g for g in guards if g.tripped]
    worse = [e for e in evidence if e.status == "worse"]
    fired = [d for d in detectors if d.fired]
    if tripped or worse or fired:
        reasons += [_guard_reason(g) for g in tripped]
        reasons += [d.explanation for d in fired]
        reasons += [f"{describe(e, level)}: confidently worse on the canary." for e in worse]
        return Verdict(Decision.ROLLBACK, tuple(reasons), evidence, guards, detectors, users_s, users_c, st)

    primary = [e for e in evidence if _is_primary(e, policy.metrics)]
    holding = [d for d in detectors if d.holding]
    enough = min(users_s, users_c) >= policy.min_users
    non_inferior = all(e.status in ("non_inferior", "better") for e in primary)
    improved = any(e.status == "better" for e in primary)
    if enough and non_inferior and not holding and (improved or not policy.require_improvement):
        reasons.append("Every primary metric is, with confidence, no worse than its minimum "
                       "detectable effect" + (", and at least one is better"
                                              if policy.require_improvement else "")
                       + "; no guardrail or reward-hacking detector fired.")
        reasons += [f"{describe(e, level)}." for e in primary]
        return Verdict(Decision.PROMOTE, tuple(reasons), evidence, guards, detectors, users_s, users_c, st)

    out_of_users = min(users_s, users_c) >= policy.max_users
    out_of_time = elapsed_s >= policy.max_duration_s
    waiting = [e for e in primary if e.status not in ("non_inferior", "better")]
    reasons += [d.explanation for d in holding]
    if not enough:
        reasons.append(f"Waiting for {policy.min_users} users per arm "
                       f"(stable {users_s}, canary {users_c}).")
    else:
        reasons += [f"{describe(e, level)}: not yet shown to be within "
                    f"{fmt_delta(e.metric, e.mde, sign=False)} of stable." for e in waiting]
        if non_inferior and not improved and policy.require_improvement:
            reasons.append("No primary metric is yet shown to be better, which promotion requires.")
    if out_of_users or out_of_time:
        budget = (f"the sample budget of {policy.max_users} users per arm" if out_of_users
                  else f"the time budget of {fmt_duration(policy.max_duration_s)}")
        reasons.insert(0, f"Inconclusive: {budget} is spent without a decision; "
                          "abort the canary rather than promote it.")
        return Verdict(Decision.INCONCLUSIVE, tuple(reasons), evidence, guards, detectors,
                       users_s, users_c, st)
    return Verdict(Decision.CONTINUE, tuple(reasons), evidence, guards, detectors, users_s, users_c, st)


def _with_columns(c: CohortData) -> CohortData:
    """``c`` carrying its columns (built once here when the caller kept none)."""
    return c if c.columns is not None else replace(c, columns=columns_of(c))


def guardrails(stable: CohortData, canary: CohortData, policy: JudgePolicy,
               arms: tuple[IndexedArm, IndexedArm] | None = None,
               strata: int = 1) -> tuple[GuardrailResult, ...]:
    """Absolute ceilings, each an anytime-valid test on the canary alone: the share of its
    requests over the ceiling (failed, or slower than the p99 ceiling) must be confidently above
    what the ceiling allows (the error-rate ceiling; 1% for a p99), with the counts discounted by
    their design effect (clustered by user). It trips only if the canary is also worse than stable
    within the same time strata (a ceiling both arms break is not the canary's fault)."""
    g = policy.guardrails
    if arms is None:
        s_, c_, strata = index_arms(stable, canary, (), policy.stratum_s)
        arms = (s_, c_)
    needed = math.log(1.0 / policy.alpha_per_test())
    enough = canary.request_count() >= g.min_requests

    def result(name: str, cells: tuple[Cells, Cells], k: int, n: int, q0: float,
               values: tuple[float, float], ceiling: float) -> GuardrailResult:
        c = cells[1]
        clustered = _clustered_var(c)
        deff = design_effect(k, n, clustered)
        log_lr = float(exceedance_log_lr(k / deff, n / deff, q0)) if n > 0 else 0.0
        diff = stratified_difference(cells[0], c, strata, None).estimate
        if not math.isfinite(diff):  # too few users to compare within strata: plain shares
            diff = k / max(n, 1) - _share(cells[0])
        tripped = enough and log_lr >= needed and diff > 0
        return GuardrailResult(name, values[1], values[0], ceiling, tripped, k, n,
                               float(math.exp(min(log_lr, 700.0))))

    err = (error_cells(arms[0], stable.unattributed_errors()),
           error_cells(arms[1], canary.unattributed_errors()))
    slow = tuple(cells_of(a, (a.cols.latency_ms > g.max_p99_latency_ms).astype(np.float64)) for a in arms)
    err_rates = (stable.error_count() / max(1, stable.request_count()),
                 canary.error_count() / max(1, canary.request_count()))
    p99 = (quantile(arms[0].cols.latency_ms, 0.99), quantile(arms[1].cols.latency_ms, 0.99))
    return (
        result("error_rate", err, canary.error_count(), canary.request_count(), g.max_error_rate,
               err_rates, g.max_error_rate),
        result("p99_latency_ms", (slow[0], slow[1]), int(slow[1].num.sum()), int(slow[1].num.size), 0.01,
               p99, g.max_p99_latency_ms),
    )


def _clustered_var(c: Cells) -> float:
    """User-clustered variance of a rate over all of an arm's cells (no strata)."""
    s = np.bincount(c.user, weights=c.num, minlength=c.users)
    n = np.bincount(c.user, weights=c.den, minlength=c.users)
    keep = n > 0
    s, n = s[keep], n[keep]
    _, var = ratio_mean_var(s.sum(), n.sum(), (s * s).sum(), (s * n).sum(), (n * n).sum(), int(keep.sum()))
    return float(var)


def _share(c: Cells) -> float:
    total = float(c.den.sum())
    return float(c.num.sum()) / total if total > 0 else 0.0


def _metric(spec: MetricSpec, stable: CohortData, canary: CohortData,
            arms: tuple[IndexedArm, IndexedArm], strata: int, policy: JudgePolicy, alpha_t: float,
            st: JudgeState) -> MetricEvidence:
    tau = policy.mixture_scale * spec.mde
    if spec.name == "error_rate":
        cells = (error_cells(arms[0], stable.unattributed_errors()),
                 error_cells(arms[1], canary.unattributed_errors()))
    else:
        cells = _cells(spec.name, *arms, tail_cap=policy.tail_cap_quantile)
    return compare_cells(spec.name, cells[0], cells[1], strata, cap=policy.user_weight_cap,
                         direction=spec.direction, mde=spec.mde, tau=tau, alpha=alpha_t,
                         min_n=policy.min_users, state=st, min_n_worse=policy.rollback_min_users)


def _cells(name: str, stable: IndexedArm, canary: IndexedArm,
           tail_cap: float | None = None) -> tuple[Cells, Cells]:
    if name in CONTINUOUS and tail_cap is not None:
        return capped_cells(stable, canary, name, tail_cap)
    if name == "latency_tail":
        threshold = quantile(np.concatenate([stable.cols.latency_ms, canary.cols.latency_ms]), 0.95)
        return tuple(cells_of(a, (a.cols.latency_ms > threshold).astype(np.float64))  # type: ignore[return-value]
                     for a in (stable, canary))
    if name in SESSION_RATIOS:
        return session_cells(stable, name), session_cells(canary, name)
    if name not in METRICS:
        known = sorted([*METRICS, *SESSION_RATIOS, "latency_tail", "error_rate"])
        raise ValueError(f"unknown metric {name!r}; known: {known}")
    return metric_cells(stable, name), metric_cells(canary, name)



def _is_primary(e: MetricEvidence, specs: tuple[MetricSpec, ...]) -> bool:
    return any(s.name == e.metric and s.primary for s in specs)


def describe(e: MetricEvidence, level: float) -> str:
    """One plain-English clause with the numbers a reviewer needs."""
    label = LABELS.get(e.metric, e.metric)
    if e.status == "insufficient":
        return f"{label.capitalize()}: too few users yet ({e.n_canary} canary, {e.n_stable} stable)"
    unit = "users"
    return (f"{label.capitalize()} {fmt_value(e.metric, e.canary_mean)} on the canary vs "
            f"{fmt_value(e.metric, e.stable_mean)} on stable (difference "
            f"{fmt_delta(e.metric, e.estimate)}, always-valid {level:.1%} interval "
            f"{fmt_delta(e.metric, e.ci_lower)} to {fmt_delta(e.metric, e.ci_upper)}, "
            f"p={e.p_value:.2g}; {e.n_canary:,} vs {e.n_stable:,} {unit})")


def _guard_reason(g: GuardrailResult) -> str:
    if g.name == "error_rate":
        return (f"Guardrail: canary error rate {g.canary_value:.2%} is confidently over the "
                f"{g.ceiling:.2%} ceiling ({g.exceeding:,} of {g.requests:,} canary requests failed; "
                f"stable {g.stable_value:.2%}).")
    return (f"Guardrail: canary p99 latency {g.canary_value:,.0f} ms is confidently over the "
            f"{g.ceiling:,.0f} ms ceiling ({g.exceeding:,} of {g.requests:,} canary requests took "
            f"longer, more than the 1% a p99 under the ceiling allows; stable "
            f"{g.stable_value:,.0f} ms).")
