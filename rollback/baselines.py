"""Baseline judges the benchmark compares ours with, as such judges run in practice.

All three see the per-interval aggregate of each metric (one value per arm per tick, the way
a metrics store returns a time series) and judge every tick:

- Kayenta-style: a two-sided Mann-Whitney U test per metric on the canary's and the
  baseline's interval values since the start, at 0.98 confidence; a metric fails when the
  test rejects in the bad direction, and (metrics marked critical) one failing metric fails
  the canary. Run at every interval, as a canary stage with an interval does.
- Kayenta-style fixed horizon: the same test, run once at the end of the budget.
- Flagger-style: each interval, the canary's value for that interval against a fixed
  threshold per metric (the benchmark sets it at the baseline level moved by the MDE in the
  bad direction, or further out to stable's own 1st/99th percentile); an interval with any
  failed check increments a failure counter that is never reset; the canary rolls back when
  the counter reaches ``failure_threshold`` (Flagger's ``threshold``).

Each function is vectorised over canaries: inputs are (canaries, ticks) arrays of interval
values, the output the first tick (0-based) at which the judge rolls back, or -1.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray
from scipy import stats

from rollback.types import Direction

IntArr = NDArray[np.int64]
Arr = NDArray[np.float64]

KAYENTA_CONFIDENCE = 0.98
KAYENTA_MIN_INTERVALS = 3
"""Mann-Whitney on fewer than three points per arm cannot reject at 0.98; judging starts here."""
FLAGGER_FAILURE_THRESHOLD = 5


def first_true(flags: NDArray[np.bool_]) -> IntArr:
    """Index of the first True along the last axis, -1 where there is none."""
    any_ = flags.any(axis=-1)
    return np.where(any_, flags.argmax(axis=-1), -1).astype(np.int64)


def mann_whitney_fails(
    baseline: Arr, canary: Arr, direction: Direction, confidence: float = KAYENTA_CONFIDENCE
) -> NDArray[np.bool_]:
    """Per row: does a two-sided Mann-Whitney test at ``confidence`` reject with the canary
    worse? ``baseline`` and ``canary`` are (canaries, points)."""
    res = stats.mannwhitneyu(canary, baseline, alternative="two-sided", axis=-1, method="asymptotic")
    u = np.asarray(res.statistic, dtype=np.float64)
    n1, n2 = canary.shape[-1], baseline.shape[-1]
    bad = u > n1 * n2 / 2.0 if direction == "lower_is_better" else u < n1 * n2 / 2.0
    rejects: NDArray[np.bool_] = (np.asarray(res.pvalue) < 1.0 - confidence) & bad
    return rejects


def kayenta_sequential(baseline: dict[str, Arr], canary: dict[str, Arr],
                       directions: dict[str, Direction]) -> IntArr:
    """First tick at which the every-interval Kayenta-style judge fails the canary."""
    n_canaries, ticks = next(iter(canary.values())).shape
    failed = np.zeros((n_canaries, ticks), dtype=bool)
    for t in range(KAYENTA_MIN_INTERVALS - 1, ticks):
        for name, direction in directions.items():
            failed[:, t] |= mann_whitney_fails(baseline[name][:, : t + 1], canary[name][:, : t + 1],
                                               direction)
    return first_true(failed)


def kayenta_fixed(baseline: dict[str, Arr], canary: dict[str, Arr],
                  directions: dict[str, Direction]) -> IntArr:
    """The same test once, at the last tick: the tick index, or -1 if it passes."""
    n_canaries, ticks = next(iter(canary.values())).shape
    failed = np.zeros(n_canaries, dtype=bool)
    for name, direction in directions.items():
        failed |= mann_whitney_fails(baseline[name], canary[name], direction)
    return np.where(failed, ticks - 1, -1).astype(np.int64)


def flagger(canary: dict[str, Arr], thresholds: dict[str, float], directions: dict[str, Direction],
            failure_threshold: int = FLAGGER_FAILURE_THRESHOLD) -> IntArr:
    """First tick at which the failed-check count reaches ``failure_threshold``."""
    n_canaries, ticks = next(iter(canary.values())).shape
    failed = np.zeros((n_canaries, ticks), dtype=bool)
    for name, direction in directions.items():
        v = canary[name]
        failed |= v < thresholds[name] if direction == "higher_is_better" else v > thresholds[name]
    return first_true(np.cumsum(failed, axis=-1) >= failure_threshold)
