"""Per-request metric values and the two-arm comparison every metric and detector shares."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
from numpy.typing import NDArray

from rollback.columns import columns_from, metric_values, session_ratio
from rollback.stats import CellIndex, Cells, cell_index, mixture_radius, msprt_p_value, stratified_difference
from rollback.types import (
    CohortData,
    Columns,
    Direction,
    JudgeState,
    MetricEvidence,
    MetricSpec,
    RequestOutcome,
    Status,
)

V = TypeVar("V", float, NDArray[np.float64])

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
of invalid to all tool calls) and ``error_rate`` (gateway counts) are computed in the judge.
This is the plain definition; the judge computes the same values on columns
(``rollback.columns.metric_values``)."""

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
    "session_completion": "session completion rate",
    "turns_per_completed": "turns per completed session",
    "session_invalid_tool_rate": "share of sessions with an invalid tool call",
}

RATES = frozenset({"persistence", "acceptance", "dissatisfied", "error_rate", "latency_tail",
                   "edit_rate", "question_rate", "abstention_rate", "invalid_tool_rate",
                   "session_completion", "session_invalid_tool_rate"})
CONTINUOUS = frozenset({"reward", "latency_ms", "completion_length"})
"""Metrics whose per-request values are unbounded: the judge compares them with both tails
capped at pooled quantiles (``capped_cells``)."""
UNITS = {"latency_ms": "ms", "completion_length": "tokens", "turns_per_completed": "turns"}


def session_metrics() -> tuple[MetricSpec, ...]:
    """The per-session metrics, judged beside the per-request ones when the reward spec has
    agent sessions: the completion rate must not fall (primary); more turns per completed
    session or more sessions with broken tool calls roll back."""
    return (
        MetricSpec("session_completion", 0.05, "higher_is_better"),
        MetricSpec("turns_per_completed", 0.5, "lower_is_better", primary=False),
        MetricSpec("session_invalid_tool_rate", 0.05, "lower_is_better", primary=False),
    )


def fmt_value(metric: str, x: float) -> str:
    """A metric's value as a reviewer reads it: rates in %, latency in ms."""
    if not math.isfinite(x):
        return "n/a"
    if metric in RATES:
        return f"{x:.1%}"
    if metric in UNITS:
        return f"{x:,.0f} {UNITS[metric]}" if abs(x) >= 100 else f"{x:.3g} {UNITS[metric]}"
    return f"{x:.3g}"


def fmt_duration(seconds: float) -> str:
    """A time budget as people say it: ``90 s``, ``3.5 min``, ``6 h``."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.3g} min"
    return f"{seconds / 3600:.3g} h"


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

@dataclass(frozen=True)
class IndexedArm:
    """An arm's outcomes (as columns) with each request's user and time stratum as integer
    indices, built once per tick. Error events (the gateway's per-user error counts) are
    indexed alongside."""

    cols: Columns
    stratum: NDArray[np.int64]
    users: int
    """Distinct user indices, including users seen only in error events."""
    error_user: NDArray[np.int64]
    error_stratum: NDArray[np.int64]
    error_count: NDArray[np.float64]
    cells: CellIndex
    """Each request's (user, stratum) cell, shared by the arm's metrics."""

    @property
    def user(self) -> NDArray[np.int64]:
        """Each request's user index (the columns')."""
        return self.cols.user


class Strata:
    """Maps serving times to time strata: a new stratum at every weight change (``boundaries``,
    the canary's start first) and every ``width_s`` seconds since the first boundary (or the
    earliest time seen). Requests in one stratum were served under one weight, close in time."""

    def __init__(self, times: NDArray[np.float64], boundaries: Sequence[float], width_s: float) -> None:
        self.bounds = np.sort(np.asarray(boundaries, dtype=np.float64))
        self.t0 = float(self.bounds[0]) if self.bounds.size else float(times.min(initial=0.0))
        self.width_s = width_s
        self.keys, self.index = np.unique(self._raw(times), return_inverse=True)

    def _raw(self, times: NDArray[np.float64]) -> NDArray[np.int64]:
        bucket = np.floor(np.maximum(times - self.t0, 0.0) / self.width_s).astype(np.int64)
        step = np.searchsorted(self.bounds, times, side="right").astype(np.int64)
        return bucket * (self.bounds.size + 1) + step

    @property
    def count(self) -> int:
        return max(int(self.keys.size), 1)

    def of(self, times: NDArray[np.float64]) -> NDArray[np.int64]:
        """Strata of ``times`` (which must be among those the strata were built from)."""
        return np.searchsorted(self.keys, self._raw(times)).astype(np.int64)


def columns_of(c: CohortData) -> Columns:
    """The arm's columns: those it carries, else built from its outcomes."""
    return c.columns if c.columns is not None else columns_from(c.outcomes)


def index_arms(stable: CohortData, canary: CohortData, boundaries: Sequence[float] = (),
               stratum_s: float = math.inf) -> tuple[IndexedArm, IndexedArm, int]:
    """Both arms indexed against the same strata; returns (stable, canary, number of strata)."""
    cols = (columns_of(stable), columns_of(canary))
    times = [c.ts for c in cols]
    err_times = [np.fromiter((e.ts for e in c.user_errors), dtype=np.float64, count=len(c.user_errors))
                 for c in (stable, canary)]
    strata = Strata(np.concatenate([*times, *err_times]), boundaries, stratum_s)
    stable_arm = _index(stable, cols[0], strata, err_times[0])
    canary_arm = _index(canary, cols[1], strata, err_times[1])
    return stable_arm, canary_arm, strata.count


def _index(c: CohortData, cols: Columns, strata: Strata, err_times: NDArray[np.float64]) -> IndexedArm:
    """Users are numbered in order of first appearance (the columns'), then users seen only
    in error events."""
    ids = {key: i for i, key in enumerate(cols.user_keys)}
    error_user = np.fromiter((ids.setdefault(e.user_key, len(ids)) for e in c.user_errors),
                             dtype=np.int64, count=len(c.user_errors))
    count = np.fromiter((e.count for e in c.user_errors), dtype=np.float64, count=len(c.user_errors))
    stratum = strata.of(cols.ts)
    return IndexedArm(cols, stratum, len(ids), error_user, strata.of(err_times), count,
                      cell_index(cols.user, stratum, strata.count))


def cells_of(arm: IndexedArm, values: NDArray[np.float64], counted: NDArray[np.bool_] | None = None) -> Cells:
    """A per-request metric's cells from its values (requests where ``counted`` is False do
    not count; None: all do)."""
    return ratio_cells(arm, values, np.ones(values.size), counted)


def metric_cells(arm: IndexedArm, name: str) -> Cells:
    """The cells of a metric of ``METRICS``."""
    return cells_of(arm, *metric_values(arm.cols, name))


def capped_cells(stable: IndexedArm, canary: IndexedArm, name: str, q: float) -> tuple[Cells, Cells]:
    """A continuous metric's cells with each value clipped to the [1 - q, q] quantiles of both
    arms pooled (winsorized): the same bounds for both arms, so an A/A canary stays A/A, and a
    heavy tail cannot keep the mean's interval wide. An empty pool leaves values as they are."""
    values = (metric_values(stable.cols, name)[0], metric_values(canary.cols, name)[0])
    pooled = np.concatenate(values)
    if pooled.size:
        lo, hi = np.quantile(pooled, (1.0 - q, q))
        values = (np.clip(values[0], lo, hi), np.clip(values[1], lo, hi))
    return cells_of(stable, values[0]), cells_of(canary, values[1])


def session_cells(arm: IndexedArm, name: str) -> Cells:
    """A per-session metric's cells (``rollback.columns.SESSION_RATIOS``): the ratio of its two
    columns over the requests that carry a session's figures (denominator > 0), so a user
    counts for it only with sessions."""
    num, den = session_ratio(arm.cols, name)
    return ratio_cells(arm, num, den, den > 0)


def ratio_cells(arm: IndexedArm, num: NDArray[np.float64], den: NDArray[np.float64],
                counted: NDArray[np.bool_] | None = None) -> Cells:
    """Cells of a ratio of two per-request quantities (e.g. invalid tool calls / tool calls);
    requests where ``counted`` is False do not count (None: all do)."""
    if counted is None:
        return Cells(arm.user, arm.stratum, num, den, arm.users, arm.cells)
    cells = arm.cells._replace(cell=arm.cells.cell[counted])
    return Cells(arm.user[counted], arm.stratum[counted], num[counted], den[counted], arm.users, cells)


def error_cells(arm: IndexedArm, unattributed: int = 0) -> Cells:
    """The error rate's cells: every served request with a reward record counts as one success,
    every gateway error as one failure of the user it failed for. ``unattributed`` errors (no
    user known) count as one user each, in the latest stratum."""
    n_ok = int(arm.cols.user.size)
    last = int(max(arm.stratum.max(initial=0), arm.error_stratum.max(initial=0)))
    extra = np.arange(arm.users, arm.users + unattributed, dtype=np.int64)
    return Cells(
        np.concatenate([arm.user, arm.error_user, extra]),
        np.concatenate([arm.stratum, arm.error_stratum, np.full(unattributed, last, dtype=np.int64)]),
        np.concatenate([np.zeros(n_ok), arm.error_count, np.ones(unattributed)]),
        np.concatenate([np.ones(n_ok), arm.error_count, np.ones(unattributed)]),
        arm.users + unattributed,
    )


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
    min_n_worse: int | None = None,
) -> MetricEvidence:
    """Compare two arms given (mean, variance of the mean, n) for each.

    ``stable``/``canary`` are (mean, var, n, unused). ``alpha`` is this test's one-sided
    error; the two-sided confidence sequence is built at 2·alpha. The running minimum of the
    always-valid p-value is read from and written to ``state`` under ``p.<metric>``.

    ``min_n_worse`` (at most ``min_n``): from this many users per arm a confident regression
    already counts ("worse"); anything else stays "insufficient" until ``min_n``. In that early
    phase each arm's variance is at least the larger per-user variance of the two over its own
    users (:func:`early_variances`), so a small arm that looks steady by chance cannot narrow
    the interval (the evidence still reports the variances the arms show).
    """
    m_s, v_s, n_s, _ = stable
    m_c, v_c, n_c, _ = canary
    est = m_c - m_s
    floor = min_n if min_n_worse is None else min(min_n_worse, min_n)
    early, counted = min(n_s, n_c) < min_n, min(n_s, n_c) >= floor
    var = float(sum(early_variances(v_s, n_s, v_c, n_c))) if early and counted else v_s + v_c
    enough = counted and math.isfinite(var) and math.isfinite(est)
    if not enough:
        return MetricEvidence(metric, direction, m_s, m_c, est, -math.inf, math.inf,
                              state.get(f"p.{metric}", 1.0), int(n_s), int(n_c), mde, "insufficient",
                              float(v_s), float(v_c))
    var = max(var, (mde * 1e-3) ** 2)  # two constant arms: keep the bound finite, not zero-width
    r = float(mixture_radius(var, tau, min(0.5, 2 * alpha)))
    p = min(state.get(f"p.{metric}", 1.0), float(msprt_p_value(est, var, tau)))
    state[f"p.{metric}"] = p
    lower, upper = est - r, est + r
    status = classify(direction, lower, upper, mde)
    if early and status != "worse":
        status = "insufficient"
    return MetricEvidence(metric, direction, m_s, m_c, est, lower, upper, p, int(n_s), int(n_c), mde,
                          status, float(v_s), float(v_c))


def early_variances(v_s: V, n_s: V, v_c: V, n_c: V) -> tuple[V, V]:
    """Each arm's variance of its mean, at least the larger of the two per-user variances
    (``v · n``) over its own users: what a small arm is judged on before ``min_users``
    (numbers, or arrays element by element)."""
    per_user = np.maximum(v_s * n_s, v_c * n_c)
    return np.maximum(v_s, per_user / n_s), np.maximum(v_c, per_user / n_c)


def compare_cells(metric: str, stable: Cells, canary: Cells, strata: int, *, cap: float | None,
                  direction: Direction, mde: float, tau: float, alpha: float, min_n: int,
                  state: JudgeState, min_n_worse: int | None = None) -> MetricEvidence:
    """The stratified, user-clustered comparison of one metric, as evidence."""
    st = stratified_difference(stable, canary, strata, cap)
    return compare(metric, (st.stable_mean, st.var_stable, st.users_stable, 0),
                   (st.canary_mean, st.var_canary, st.users_canary, 0), direction=direction, mde=mde,
                   tau=tau, alpha=alpha, min_n=min_n, state=state, min_n_worse=min_n_worse)
