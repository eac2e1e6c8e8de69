"""Per-request metric values and the two-arm comparison every metric and detector shares."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from rollback.stats import grouped_sums, mixture_radius, msprt_p_value, ratio_mean_var
from rollback.types import Direction, JudgeState, MetricEvidence, RequestOutcome, Status

ValueFn = Callable[[RequestOutcome], float | None]

METRICS: dict[str, ValueFn] = {
    "persistence": lambda o: o.persistence,
    "acceptance": lambda o: None if o.accepted is None else float(o.accepted),
    "reward": lambda o: o.reward,
    "latency_ms": lambda o: o.latency_ms,
    "dissatisfied": lambda o: float(o.dissatisfied > 0),
    "edit_rate": lambda o: float(o.completion_kind == "edit"),
    "question_rate": lambda o: float(o.completion_kind == "question"),
    "abstention_rate": lambda o: float(o.completion_kind == "empty"),
    "completion_length": lambda o: float(o.completion_tokens),
}
"""Metric name -> per-request value (None: the request does not count for this metric).
``latency_tail`` (share of requests slower than the pooled p95), ``invalid_tool_rate`` (a ratio
of invalid to all tool calls) and ``error_rate`` (gateway counts) are computed in the judge."""

LABELS = {
    "persistence": "edit persistence",
    "acceptance": "acceptance rate",
    "reward": "mean reward",
    "latency_ms": "mean latency",
    "latency_tail": "share of requests slower than the pooled p95",
    "dissatisfied": "dissatisfied follow-up rate",
    "error_rate": "error rate",
    "edit_rate": "edit rate",
    "question_rate": "clarifying-question rate",
    "abstention_rate": "empty-completion rate",
    "invalid_tool_rate": "invalid tool-call rate",
    "completion_length": "mean completion length",
}

RATES = frozenset({"persistence", "acceptance", "dissatisfied", "error_rate", "latency_tail",
                   "edit_rate", "question_rate", "abstention_rate", "invalid_tool_rate"})
UNITS = {"latency_ms": "ms", "completion_length": "tokens"}


def fmt_value(metric: str, x: float) -> str:
    """A metric's value as a reviewer reads it: rates in %, latency in ms."""
    if not math.isfinite(x):
        return "n/a"
    if metric in RATES:
        return f"{x:.1%}"
    if metric in UNITS:
        return f"{x:,.0f} {UNITS[metric]}" if abs(x) >= 100 else f"{x:.3g} {UNITS[metric]}"
    return f"{x:.3g}"


def fmt_delta(metric: str, x: float, sign: bool = True) -> str:
    """A difference: percentage points for rates, units otherwise."""
    if not math.isfinite(x):
        return "unbounded"
    plus = "+" if sign else ""
    if metric in RATES:
        return f"{x * 100:{plus}.1f} pts"
    if metric in UNITS:
        return f"{x:{plus},.1f} {UNITS[metric]}"
    return f"{x:{plus}.3g}"

Sums = tuple[float, float, float, float, float, int]


@dataclass(frozen=True)
class IndexedArm:
    """An arm's outcomes with each request's user as an integer index, built once per tick."""

    outcomes: tuple[RequestOutcome, ...]
    user: NDArray[np.int64]
    users: int


def index_arm(outcomes: tuple[RequestOutcome, ...] | IndexedArm) -> IndexedArm:
    if isinstance(outcomes, IndexedArm):
        return outcomes
    ids: dict[str, int] = {}
    user = np.fromiter((ids.setdefault(o.user_key, len(ids)) for o in outcomes), dtype=np.int64,
                       count=len(outcomes))
    return IndexedArm(outcomes, user, len(ids))


def sums_for(arm: IndexedArm, fn: ValueFn) -> Sums:
    """Per-user sums of a per-request metric (requests where ``fn`` is None do not count)."""
    raw = [fn(o) for o in arm.outcomes]
    counted = np.fromiter((v is not None for v in raw), dtype=bool, count=len(raw))
    values = np.fromiter((0.0 if v is None else v for v in raw), dtype=np.float64, count=len(raw))
    return grouped_sums(arm.user[counted], values[counted], np.ones(int(counted.sum())), arm.users)


def ratio_sums(arm: IndexedArm, num: ValueFn, den: ValueFn) -> Sums:
    """Sums for a ratio of two per-request quantities (e.g. invalid tool calls / tool calls)."""
    n = np.fromiter((den(o) or 0.0 for o in arm.outcomes), dtype=np.float64, count=len(arm.outcomes))
    s = np.fromiter((num(o) or 0.0 for o in arm.outcomes), dtype=np.float64, count=len(arm.outcomes))
    return grouped_sums(arm.user, s, n, arm.users)


def classify(
    direction: Direction, lower: float, upper: float, mde: float
) -> Status:
    """worse / better / non_inferior / undecided from the confidence bounds on canary − stable."""
    if direction == "higher_is_better":
        if upper < 0:
            return "worse"
        if lower > 0:
            return "better"
        return "non_inferior" if lower > -mde else "undecided"
    if lower > 0:
        return "worse"
    if upper < 0:
        return "better"
    return "non_inferior" if upper < mde else "undecided"


def compare(
    metric: str,
    stable: tuple[float, float, float, float],
    canary: tuple[float, float, float, float],
    *,
    direction: Direction,
    mde: float,
    tau: float,
    alpha: float,
    min_n: int,
    state: JudgeState,
) -> MetricEvidence:
    """Compare two arms given (mean, variance of the mean, n) for each.

    ``stable``/``canary`` are (mean, var, n, unused). ``alpha`` is this test's one-sided
    error; the two-sided confidence sequence is built at 2·alpha. The running minimum of the
    always-valid p-value is read from and written to ``state`` under ``p.<metric>``.
    """
    m_s, v_s, n_s, _ = stable
    m_c, v_c, n_c, _ = canary
    est = m_c - m_s
    var = v_s + v_c
    enough = n_s >= min_n and n_c >= min_n and math.isfinite(var) and math.isfinite(est)
    if not enough:
        return MetricEvidence(metric, direction, m_s, m_c, est, -math.inf, math.inf,
                              state.get(f"p.{metric}", 1.0), int(n_s), int(n_c), mde, "insufficient")
    var = max(var, (mde * 1e-3) ** 2)  # two constant arms: keep the bound finite, not zero-width
    r = float(mixture_radius(var, tau, min(0.5, 2 * alpha)))
    p = min(state.get(f"p.{metric}", 1.0), float(msprt_p_value(est, var, tau)))
    state[f"p.{metric}"] = p
    lower, upper = est - r, est + r
    status = classify(direction, lower, upper, mde)
    return MetricEvidence(metric, direction, m_s, m_c, est, lower, upper, p, int(n_s), int(n_c), mde,
                          status)


def arm_stats(sums: Sums) -> tuple[float, float, float, float]:
    s, n, s2, sn, n2, users = sums
    m, v = ratio_mean_var(s, n, s2, sn, n2, users)
    return float(m), float(v), float(users), n
