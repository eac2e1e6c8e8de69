"""Kayenta- and Flagger-style judges on the traffic of ``rtrl bench judge --schedule``
(bench/judge_schedule.py), each running its canary the way such a tool runs it.

Every baseline sees what a metrics store returns: one value per arm per interval, the interval
being the bench's tick: the mean latency of the requests served in it (a proxy's metrics have
it at once), persistence and the dissatisfied rate of the records that became visible in it
(after the persistence horizon, as for our judge). The canary moves
through the deployer's steps (1 → 5 → 25 → 50 %), each held for ``CanaryPolicy.bake_s`` (10
minutes): a fixed schedule, as a canary analysis with step weights and an interval is
configured. Metrics: persistence (higher is better), mean latency and the dissatisfied rate
(lower is better), the metrics an operator would watch.

- ``kayenta``: at every interval from the third, a Mann-Whitney test per metric on all the
  interval values so far (rollback/baselines.py); a rejection in the bad direction rolls back;
  the canary is promoted at the end of the schedule.
- ``kayenta_fixed``: the same test once, at the end of the schedule.
- ``flagger``: each interval, the canary's value against a threshold per metric (stable's level
  so far moved by the metric's MDE in the bad direction, or beyond stable's own 1st/99th
  percentile interval value so far if that is further out); five failed intervals roll back;
  promoted at the end of the schedule.

Results are :class:`bench.judge_schedule.Result` s, summarised as the bench's own judge is.
"""

from __future__ import annotations

import math

import numpy as np

from bench.judge_schedule import SHAPES, Result, Traffic
from deployer.status import CanaryPolicy
from rollback import baselines
from rollback.types import Direction, RequestOutcome, default_metrics

BASELINES = ("kayenta", "kayenta_fixed", "flagger")
LABEL = {"kayenta": "Kayenta-style MW, every interval", "kayenta_fixed": "Kayenta-style MW, at the end",
         "flagger": "Flagger-style threshold x5"}
DIRECTIONS: dict[str, Direction] = {"persistence": "higher_is_better", "latency_ms": "lower_is_better",
                                    "dissatisfied": "lower_is_better"}
MDES = {m.name: m.mde for m in default_metrics() if m.name in DIRECTIONS}


def value(outcomes: list[RequestOutcome], metric: str) -> float:
    """The interval's mean of ``metric`` over the records that carry it (nan: none)."""
    if metric == "persistence":
        xs = [o.persistence for o in outcomes if o.persistence is not None]
    elif metric == "latency_ms":
        xs = [o.latency_ms for o in outcomes]
    else:
        xs = [float(o.dissatisfied > 0) for o in outcomes]
    return float(np.mean(xs)) if xs else math.nan


def flagger_threshold(stable: list[float], metric: str) -> float:
    """Where a careful operator would put the check, from stable's intervals so far."""
    seen = np.array([v for v in stable if np.isfinite(v)])
    level, direction = float(np.mean(seen)), DIRECTIONS[metric]
    if direction == "higher_is_better":
        return min(level - MDES[metric], float(np.quantile(seen, 0.01)))
    return max(level + MDES[metric], float(np.quantile(seen, 0.99)))


def flagger_fails(canary_value: float, stable: list[float], metric: str) -> bool:
    if not np.isfinite(canary_value) or sum(np.isfinite(stable)) < 3:
        return False  # no data in the interval: Flagger skips the check (no failure counted)
    limit = flagger_threshold(stable, metric)
    return canary_value < limit if DIRECTIONS[metric] == "higher_is_better" else canary_value > limit


def kayenta_fails(stable: list[float], canary: list[float], metric: str) -> bool:
    s = np.array([v for v in stable if np.isfinite(v)])
    c = np.array([v for v in canary if np.isfinite(v)])
    if min(len(s), len(c)) < baselines.KAYENTA_MIN_INTERVALS:
        return False
    return bool(baselines.mann_whitney_fails(s[None, :], c[None, :], DIRECTIONS[metric])[0])


Series = dict[str, dict[str, list[float]]]
Waiting = list[tuple[float, str, RequestOutcome]]


def observe(traffic: Traffic, now: float, weight: float, waiting: Waiting, series: Series,
            users: set[str]) -> Waiting:
    """One interval's values per arm appended to ``series``: the latency of the requests served
    in it (a proxy's metrics have it at once), persistence and dissatisfaction of the records
    that became visible in it. Returns the records still waiting for their horizon."""
    served: dict[str, list[RequestOutcome]] = {"stable": [], "canary": []}
    for arm, o, vis in traffic.served(now, weight):
        served[arm].append(o)
        waiting.append((vis, arm, o))
    ready: dict[str, list[RequestOutcome]] = {"stable": [], "canary": []}
    for vis, arm, o in waiting:
        if vis <= now:
            ready[arm].append(o)
    users.update(o.user_key for o in served["canary"])
    for arm in ready:
        for m in DIRECTIONS:
            series[arm][m].append(value(served[arm] if m == "latency_ms" else ready[arm], m))
    return [w for w in waiting if w[0] > now]


def kayenta_any(series: Series) -> bool:
    return any(kayenta_fails(series["stable"][m], series["canary"][m], m) for m in DIRECTIONS)


def run_baseline(kind: str, shape_name: str, seed: int, tick_s: float, users_per_min: float) -> Result:
    """One canary judged by the baseline ``kind`` on the fixed schedule."""
    shape = SHAPES[shape_name]
    traffic = Traffic(shape, np.random.default_rng(seed), users_per_min)
    steps, step_s = CanaryPolicy().steps, CanaryPolicy().bake_s
    series: Series = {a: {m: [] for m in DIRECTIONS} for a in ("stable", "canary")}
    waiting: Waiting = []
    users: set[str] = set()
    failures, now = 0, 0.0
    while now < len(steps) * step_s:
        weight = steps[min(int(now // step_s), len(steps) - 1)]
        now += tick_s
        waiting = observe(traffic, now, weight, waiting, series, users)
        if kind == "flagger":
            c, st = series["canary"], series["stable"]
            failures += any(flagger_fails(c[m][-1], st[m], m) for m in DIRECTIONS)
            if failures >= baselines.FLAGGER_FAILURE_THRESHOLD:
                return Result(shape.name, "rolled_back", now / 3600.0, len(users), "failed checks")
        elif kind == "kayenta" and kayenta_any(series):
            return Result(shape.name, "rolled_back", now / 3600.0, len(users), "Mann-Whitney")
    if kind == "kayenta_fixed" and kayenta_any(series):
        return Result(shape.name, "rolled_back", now / 3600.0, len(users), "Mann-Whitney at the end")
    return Result(shape.name, "promoted", now / 3600.0, len(users), "")
