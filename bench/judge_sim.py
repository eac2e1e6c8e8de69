"""The simulated canaries of ``rtrl bench judge`` (see bench/judge.py for what is simulated):
per-user sums of one arm, shaped (canaries, ticks, users of the busiest tick), drawn in bulk."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from numpy.typing import NDArray
from scipy import stats as sps

from rollback.stats import cap_factor
from rollback.types import CohortData, Direction, ErrorCount, RequestOutcome

Arr = NDArray[np.float64]
IntArr = NDArray[np.int64]
BoolArr = NDArray[np.bool_]

TICK_S = 300.0
"""A judged interval (the deployer judges more often; a tick here is one time stratum)."""
MAX_REQUESTS = 6
ZIPF_EXPONENT, ZIPF_MAX = 2.0, 200
LAT_MEDIAN_MS, LAT_USER_SD, LAT_REQ_SD = 400.0, 0.3, 0.7
PARETO_SHAPE, PARETO_SCALE_MS = 1.5, 150.0
RAMP = (0.01, 0.05, 0.25, 0.5)


@dataclass(frozen=True)
class SimConfig:
    ticks: int = 48
    """Judged intervals in the budget (48 × 5 min = 4 h)."""
    users_per_tick: int = 160
    """New users per arm per tick at a 50 % split (2 × this arrive per tick in all)."""
    persistence: float = 0.6
    """Stable's mean edit persistence."""
    concentration: float = 8.0
    """Beta concentration of users' persistence propensities (intra-user correlation 1/(1+c))."""
    dissatisfied: float = 0.05
    error_rate: float = 0.005
    edit_rate: float = 0.8
    schedule: Literal["even", "ramp"] = "even"
    """even: 50 % of users to the canary from the start; ramp: the deployer's steps."""
    ramp_ticks: int = 4
    """Ticks on each ramp step before the last (the bake)."""
    requests: Literal["poisson", "zipf"] = "poisson"
    latency: Literal["lognormal", "pareto"] = "lognormal"
    latency_drift: float = 0.0
    """Shared latency drift: both arms' latency rises by this share over the run."""
    persistence_cycle: float = 0.0
    """Shared persistence cycle: both arms' persistence falls from +this to −this over the run."""
    error_burst: float = 0.0
    """0: independent errors; otherwise errors come as bursts of about this many retries of one
    user (at the same overall error rate)."""
    p99_ceiling_ms: float = 10_000.0
    """The p99 guardrail's ceiling."""

    def weights(self) -> Arr:
        """The canary's share of new users at each tick."""
        if self.schedule == "even":
            return np.full(self.ticks, 0.5)
        step = np.minimum(np.arange(self.ticks) // max(self.ramp_ticks, 1), len(RAMP) - 1)
        return np.asarray(RAMP, dtype=np.float64)[step]

    def arm_users(self, arm: str) -> IntArr:
        """New users of ``arm`` at each tick."""
        total = 2 * self.users_per_tick
        canary = np.rint(self.weights() * total).astype(np.int64)
        return canary if arm == "canary" else total - canary

    def cum_users(self, arm: str) -> IntArr:
        return np.cumsum(self.arm_users(arm))

    @property
    def budget(self) -> int:
        """Users of the smaller arm over all ticks: the judge's sample budget."""
        return int(min(self.cum_users("stable")[-1], self.cum_users("canary")[-1]))

    def boundaries(self) -> tuple[float, ...]:
        """Times the weight changed (the canary's start first), as the deployer passes them."""
        w = self.weights()
        return tuple(float(t * TICK_S) for t in range(self.ticks) if t == 0 or w[t] != w[t - 1])

    def mean_requests(self) -> float:
        if self.requests == "poisson":
            k = np.arange(MAX_REQUESTS)
            p = sps.poisson.pmf(k, 2.0)
            p[-1] += 1 - p.sum()
            return float(((k + 1) * p).sum())
        sizes = np.arange(1, ZIPF_MAX + 1, dtype=np.float64)
        weights = sizes ** -ZIPF_EXPONENT
        return float((sizes * weights).sum() / weights.sum())

    def latency_mean(self) -> float:
        user = float(np.exp(LAT_USER_SD**2 / 2))
        if self.latency == "lognormal":
            return LAT_MEDIAN_MS * user * float(np.exp(LAT_REQ_SD**2 / 2))
        return PARETO_SCALE_MS * PARETO_SHAPE / (PARETO_SHAPE - 1) * user


def true_p99(cfg: SimConfig, seed: int = 0, n: int = 2_000_000) -> float:
    """The p99 of one request's latency (user effect included) without drift, by simulation."""
    rng = np.random.default_rng(seed)
    latency = _request_latency(rng, cfg, n) * np.exp(LAT_USER_SD * rng.standard_normal(n))
    return float(np.quantile(latency, 0.99))


def _request_latency(rng: np.random.Generator, cfg: SimConfig, n: int) -> Arr:
    if cfg.latency == "lognormal":
        return np.exp(np.log(LAT_MEDIAN_MS) + LAT_REQ_SD * rng.standard_normal(n))
    return PARETO_SCALE_MS * (1.0 + rng.pareto(PARETO_SHAPE, n))


@dataclass
class Arm:
    """Per-user sums of one arm, shaped (canaries, ticks, users of the busiest tick); ``valid``
    marks real users. ``latencies``/``offsets`` keep every request's latency (user-major)."""

    valid: BoolArr
    n: Arr
    """Served requests (each has a reward record)."""
    errors: Arr
    """Failed requests (no reward record)."""
    persistence: Arr
    latency: Arr
    dissatisfied: Arr
    edit: Arr
    slow: Arr
    """Requests slower than the p99 ceiling."""
    latencies: Arr
    offsets: IntArr
    sums: dict[str, Arr] = field(default_factory=dict)

    @property
    def users(self) -> Arr:
        """Users per tick, (canaries, ticks)."""
        return self.valid.sum(axis=-1, dtype=np.float64)


def simulate_arm(rng: np.random.Generator, cfg: SimConfig, canaries: int, *, arm: str = "stable",
                 persistence_shift: float = 0.0, latency_shift_ms: float = 0.0,
                 edit_shift: float = 0.0) -> Arm:
    per_tick = cfg.arm_users(arm)
    width = int(max(per_tick.max(), 1))
    shape = (canaries, cfg.ticks, width)
    valid = np.broadcast_to(np.arange(width) < per_tick[:, None], shape).copy()
    if cfg.requests == "poisson":
        n = 1 + np.minimum(rng.poisson(2.0, size=shape), MAX_REQUESTS - 1)
    else:
        n = np.minimum(rng.zipf(ZIPF_EXPONENT, size=shape), ZIPF_MAX)
    n = np.where(valid, n, 0).astype(np.float64)
    t_frac = (np.arange(cfg.ticks) + 0.5) / cfg.ticks
    mu = (cfg.persistence + persistence_shift
          + cfg.persistence_cycle * np.cos(np.pi * t_frac))[None, :, None]
    mu = np.clip(mu, 0.01, 0.99)
    p_user = rng.beta(mu * cfg.concentration, (1 - mu) * cfg.concentration, size=shape)
    ni = n.astype(np.int64)
    persistence = rng.binomial(ni, p_user).astype(np.float64)
    dissatisfied = rng.binomial(ni, cfg.dissatisfied).astype(np.float64)
    edit = rng.binomial(ni, np.clip(cfg.edit_rate + edit_shift, 0.0, 1.0)).astype(np.float64)
    if cfg.error_burst > 0:
        p_burst = cfg.error_rate * cfg.mean_requests() / cfg.error_burst
        burst = (rng.random(shape) < p_burst) & valid
        errors = np.where(burst, 1 + rng.poisson(cfg.error_burst - 1, size=shape), 0).astype(np.float64)
    else:
        errors = rng.binomial(ni, cfg.error_rate).astype(np.float64)
    # Every request's latency: user effect x request draw x shared drift x the canary's shift.
    user_level = np.exp(LAT_USER_SD * rng.standard_normal(shape))
    drift = (1.0 + cfg.latency_drift * t_frac)[None, :, None]
    scale = (user_level * drift * (1.0 + latency_shift_ms / cfg.latency_mean())).ravel()
    owner = np.repeat(np.arange(n.size), ni.ravel())
    latencies = _request_latency(rng, cfg, owner.size) * scale[owner]
    latency = np.bincount(owner, weights=latencies, minlength=n.size).reshape(shape).astype(np.float64)
    slow = np.bincount(owner, weights=(latencies > cfg.p99_ceiling_ms).astype(np.float64),
                       minlength=n.size).reshape(shape).astype(np.float64)
    offsets = np.concatenate([[0], np.cumsum(ni.ravel())])
    return Arm(valid, n, errors, persistence, latency, dissatisfied, edit, slow, latencies, offsets)


def metric_arrays(arm: Arm, name: str) -> tuple[Arr, Arr]:
    """Per-user (S, N) of a judged metric."""
    if name == "error_rate":
        return arm.errors, arm.n + arm.errors
    if name == "p99_slow":
        return arm.slow, arm.n
    field_name = {"latency_ms": "latency", "edit_rate": "edit"}.get(name, name)
    return getattr(arm, field_name), arm.n


# --- our judge's statistics, vectorised over canaries and looks ---------------------------
def metric_sums(s: Arr, n: Arr, cap: float | None) -> tuple[Arr, ...]:
    """Per-tick (ΣS, ΣN, ΣS², ΣSN, ΣN², G) after the per-user cap, (canaries, ticks)."""
    f = cap_factor(n, cap)
    s, n = s * f, n * f
    return (s.sum(-1), n.sum(-1), (s * s).sum(-1), (s * n).sum(-1), (n * n).sum(-1),
            (n > 0).sum(-1, dtype=np.float64))


# --- the judge's own input, rebuilt from the simulation (for the equivalence test) ----------
def cohort_at_tick(arm: Arm, canary_index: int, tick: int, cfg: SimConfig, name: str) -> CohortData:
    """The simulated cohort of one canary up to ``tick`` as the deployer would hand it to the judge:
    one outcome per served request (a user's successes first: only per-user sums matter), the
    gateway's counts, and failed requests by user."""
    outcomes, user_errors = [], []
    width = arm.valid.shape[-1]
    for t in range(tick + 1):
        for u in np.flatnonzero(arm.valid[canary_index, t]):
            flat = (canary_index * cfg.ticks + t) * width + u
            key, ts = f"u{t}-{u}", t * TICK_S + 1.0
            lat = arm.latencies[arm.offsets[flat]: arm.offsets[flat + 1]]
            p, d, e = (int(x[canary_index, t, u]) for x in (arm.persistence, arm.dissatisfied, arm.edit))
            for j, latency in enumerate(lat):
                outcomes.append(RequestOutcome(
                    user_key=key, reward=0.0, latency_ms=float(latency), persistence=float(j < p),
                    dissatisfied=int(j < d), completion_kind="edit" if j < e else "question", ts=ts))
            if arm.errors[canary_index, t, u]:
                user_errors.append(ErrorCount(key, ts, int(arm.errors[canary_index, t, u])))
    errors = sum(e.count for e in user_errors)
    return CohortData(name, tuple(outcomes), requests=len(outcomes) + errors,  # type: ignore[arg-type]
                      errors=errors, user_errors=tuple(user_errors))


# --- baselines' inputs: one value per arm per tick --------------------------------------------
def interval_values(arm: Arm) -> dict[str, Arr]:
    out = {}
    for name in ("persistence", "latency_ms", "dissatisfied", "error_rate"):
        s, n = metric_arrays(arm, name)
        total = n.sum(-1)
        out[name] = np.where(total > 0, s.sum(-1) / np.maximum(total, 1), np.nan)
    return out


DIRECTIONS: dict[str, Direction] = {
    "persistence": "higher_is_better", "latency_ms": "lower_is_better",
    "dissatisfied": "lower_is_better", "error_rate": "lower_is_better",
}


def flagger_thresholds(stable_intervals: dict[str, Arr], level: dict[str, float],
                       mdes: dict[str, float]) -> dict[str, float]:
    """Thresholds as a careful operator would set them: at the baseline level moved by the MDE in
    the bad direction, or beyond stable's own 1st/99th percentile interval value if that is
    further out (so a healthy canary rarely fails a check)."""
    out = {}
    for k, direction in DIRECTIONS.items():
        values = stable_intervals[k][np.isfinite(stable_intervals[k])]
        if direction == "higher_is_better":
            out[k] = min(level[k] - mdes[k], float(np.quantile(values, 0.01)))
        else:
            out[k] = max(level[k] + mdes[k], float(np.quantile(values, 0.99)))
    return out
