"""``rtrl bench judge``: the rollback judge against Kayenta- and Flagger-style judges on simulated
canaries, all checked at every tick.

Simulation (per canary, per arm): users arrive at a constant rate, ``users_per_tick`` per tick
for ``ticks`` ticks (the sample budget is ticks × users_per_tick users per arm); each user makes
1 + Poisson(2) requests (at most 6) in their session. Users differ: each has their own edit
persistence propensity (Beta around the cohort's rate, so a user's requests are correlated),
their own latency level (log-normal user effect) on top of a heavy-tailed log-normal request
latency, and binary persistence, dissatisfied follow-ups, errors and edit/non-edit completions
per request. A/A canaries have identical arms; regression scenarios shift the canary's
persistence down or its mean latency up by the metric's MDE or twice it.

Reported per judge and scenario: the share of canaries rolled back, and the median users per
arm at the rollback. For our judge, a canary's outcome is its first terminal decision
(rollback or promote); in A/A the false-rollback rate counts a rollback at ANY tick up to the
budget even after a promote verdict, the worst case for a deployer that keeps judging.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field

import numpy as np
from numpy.typing import NDArray

from rollback import baselines
from rollback.stats import mixture_radius, proportion_var, ratio_mean_var
from rollback.types import CohortData, DetectorPolicy, Direction, JudgePolicy, MetricSpec, RequestOutcome

Arr = NDArray[np.float64]
IntArr = NDArray[np.int64]

MAX_REQUESTS = 6
LAT_MEDIAN_MS, LAT_USER_SD, LAT_REQ_SD = 400.0, 0.3, 0.7
LAT_MEAN_MS = LAT_MEDIAN_MS * float(np.exp((LAT_USER_SD**2 + LAT_REQ_SD**2) / 2))


@dataclass(frozen=True)
class SimConfig:
    ticks: int = 48
    """Judged intervals in the budget (e.g. 48 × 5 min = 4 h)."""
    users_per_tick: int = 160
    """New users per arm per tick."""
    persistence: float = 0.6
    """Stable's mean edit persistence."""
    concentration: float = 8.0
    """Beta concentration of users' persistence propensities (intra-user correlation 1/(1+c))."""
    dissatisfied: float = 0.05
    error_rate: float = 0.005
    edit_rate: float = 0.8

    @property
    def budget(self) -> int:
        return self.ticks * self.users_per_tick


def bench_policy(max_users: int) -> JudgePolicy:
    """Our judge's policy in the benchmark: the metrics the simulation produces."""
    return JudgePolicy(
        alpha=0.01,
        metrics=(
            MetricSpec("persistence", 0.03, "higher_is_better"),
            MetricSpec("latency_ms", 50.0, "lower_is_better"),
            MetricSpec("dissatisfied", 0.02, "lower_is_better"),
            MetricSpec("error_rate", 0.01, "lower_is_better", primary=False),
        ),
        detectors=DetectorPolicy(enabled=("edit_rate",)),
        min_users=200,
        max_users=max_users,
    )


@dataclass
class Arm:
    """Per-request draws of one arm, (canaries, users, MAX_REQUESTS); ``mask`` marks real requests."""

    mask: NDArray[np.bool_]
    persistence: NDArray[np.bool_]
    latency: Arr
    dissatisfied: NDArray[np.bool_]
    error: NDArray[np.bool_]
    edit: NDArray[np.bool_]
    sums: dict[str, Arr] = field(default_factory=dict)

    def user_sum(self, name: str) -> Arr:
        if name not in self.sums:
            x = getattr(self, name)
            masked = (x & self.mask) if x.dtype == np.bool_ else np.where(self.mask, x, 0.0)
            self.sums[name] = masked.sum(axis=-1, dtype=np.float64)
        return self.sums[name]

    @property
    def requests(self) -> Arr:
        if "requests" not in self.sums:
            self.sums["requests"] = self.mask.sum(axis=-1, dtype=np.float64)
        return self.sums["requests"]


def simulate_arm(rng: np.random.Generator, cfg: SimConfig, canaries: int, *,
                 persistence_shift: float = 0.0, latency_shift_ms: float = 0.0,
                 edit_shift: float = 0.0) -> Arm:
    users = cfg.budget
    shape = (canaries, users, MAX_REQUESTS)
    k = 1 + np.minimum(rng.poisson(2.0, size=(canaries, users)), MAX_REQUESTS - 1)
    mask = np.arange(MAX_REQUESTS) < k[..., None]
    mu = cfg.persistence + persistence_shift
    p_user = rng.beta(mu * cfg.concentration, (1 - mu) * cfg.concentration, size=(canaries, users))
    persistence = rng.random(shape, dtype=np.float32) < p_user[..., None]
    log_lat = (np.log(LAT_MEDIAN_MS) + LAT_USER_SD * rng.standard_normal((canaries, users, 1))
               + LAT_REQ_SD * rng.standard_normal(shape))
    latency = np.exp(log_lat) * (1.0 + latency_shift_ms / LAT_MEAN_MS)
    return Arm(mask, persistence, latency,
               rng.random(shape, dtype=np.float32) < cfg.dissatisfied,
               rng.random(shape, dtype=np.float32) < cfg.error_rate,
               rng.random(shape, dtype=np.float32) < cfg.edit_rate + edit_shift)


# --- our judge, vectorised over canaries and ticks ------------------------------------------
def _cum_at_ticks(x: Arr, cfg: SimConfig) -> Arr:
    return np.cumsum(x, axis=-1)[:, cfg.users_per_tick - 1 :: cfg.users_per_tick]


def ratio_by_tick(arm: Arm, name: str, cfg: SimConfig) -> tuple[Arr, Arr]:
    """Mean and cluster-robust variance at every tick, (canaries, ticks)."""
    s, n = arm.user_sum(name), arm.requests
    users = np.arange(1, cfg.ticks + 1, dtype=np.float64) * cfg.users_per_tick
    cs, cn, cs2, csn, cn2 = (_cum_at_ticks(x, cfg) for x in (s, n, s * s, s * n, n * n))
    return ratio_mean_var(cs, cn, cs2, csn, cn2, users)


def ours_by_tick(stable: Arm, canary: Arm, cfg: SimConfig, policy: JudgePolicy) -> tuple[IntArr, IntArr]:
    """(decision code per canary and tick: 0 continue, 1 promote, -1 rollback; first terminal tick).

    The same statistics as rollback.judge.judge (tests/unit/test_judge_bench.py checks they agree).
    """
    alpha = min(0.5, 2 * policy.alpha_per_test())
    worse = np.zeros((stable.mask.shape[0], cfg.ticks), dtype=bool)
    ok = np.ones_like(worse)
    for spec in policy.metrics:
        if spec.name == "error_rate":
            req_s, req_c = (_cum_at_ticks(a.requests, cfg) for a in (stable, canary))
            m_s, v_s = proportion_var(_cum_at_ticks(stable.user_sum("error"), cfg), req_s)
            m_c, v_c = proportion_var(_cum_at_ticks(canary.user_sum("error"), cfg), req_c)
        else:
            field_name = "latency" if spec.name == "latency_ms" else spec.name
            m_s, v_s = ratio_by_tick(stable, field_name, cfg)
            m_c, v_c = ratio_by_tick(canary, field_name, cfg)
        est = m_c - m_s
        var = np.maximum(v_s + v_c, (spec.mde * 1e-3) ** 2)
        r = mixture_radius(var, policy.mixture_scale * spec.mde, alpha)
        if spec.direction == "higher_is_better":
            worse |= est + r < 0
            inferior_possible = est - r <= -spec.mde
        else:
            worse |= est - r > 0
            inferior_possible = est + r >= spec.mde
        if spec.primary:
            ok &= ~inferior_possible
    fired = np.zeros_like(worse)
    holding = np.zeros_like(worse)
    if "edit_rate" in policy.detectors.enabled:
        tol = policy.detectors.edit_rate_drop
        m_s, v_s = ratio_by_tick(stable, "edit", cfg)
        m_c, v_c = ratio_by_tick(canary, "edit", cfg)
        est = m_c - m_s
        r = mixture_radius(np.maximum(v_s + v_c, (tol * 1e-3) ** 2), policy.mixture_scale * tol, alpha)
        fired = est + r < -tol
        holding = (est < -tol) & ~fired
    users = np.arange(1, cfg.ticks + 1) * cfg.users_per_tick
    enough = users >= policy.min_users
    rollback = (worse | fired) & enough
    promote = ok & ~holding & enough & ~rollback
    code = np.where(rollback, -1, np.where(promote, 1, 0)).astype(np.int64)
    return code, baselines.first_true(code != 0)


# --- baselines' inputs: one value per arm per tick --------------------------------------------
def interval_values(arm: Arm, cfg: SimConfig) -> dict[str, Arr]:
    shape = (arm.mask.shape[0], cfg.ticks, cfg.users_per_tick)
    n = arm.requests.reshape(shape).sum(-1)
    out = {}
    for name, field_name in (("persistence", "persistence"), ("latency_ms", "latency"),
                             ("dissatisfied", "dissatisfied"), ("error_rate", "error")):
        out[name] = arm.user_sum(field_name).reshape(shape).sum(-1) / n
    return out


def cohort_at_tick(arm: Arm, canary_index: int, tick: int, cfg: SimConfig, name: str) -> CohortData:
    """The simulated cohort of one canary up to ``tick`` as the judge would receive it."""
    outcomes = []
    errors = 0
    for u in range((tick + 1) * cfg.users_per_tick):
        for j in range(int(arm.mask[canary_index, u].sum())):
            errors += int(arm.error[canary_index, u, j])
            outcomes.append(RequestOutcome(
                user_key=f"u{u}", reward=0.0, latency_ms=float(arm.latency[canary_index, u, j]),
                persistence=float(arm.persistence[canary_index, u, j]),
                dissatisfied=int(arm.dissatisfied[canary_index, u, j]),
                completion_kind="edit" if arm.edit[canary_index, u, j] else "question"))
    return CohortData(name, tuple(outcomes), requests=len(outcomes), errors=errors)  # type: ignore[arg-type]


# --- the benchmark ---------------------------------------------------------------------------
@dataclass
class Row:
    scenario: str
    judge: str
    rollback_rate: float
    median_users: float
    promote_rate: float | None = None


SCENARIOS = {
    "A/A": {},
    "persistence -MDE": {"persistence_shift": -0.03},
    "persistence -2xMDE": {"persistence_shift": -0.06},
    "latency +MDE": {"latency_shift_ms": 50.0},
    "latency +2xMDE": {"latency_shift_ms": 100.0},
    "edit rate -10 pts": {"edit_shift": -0.10},
}
"""Shifts of the canary. The last is reward hacking (fewer edits, same persistence): only our
judge watches behaviour rates, the baselines judge the four product metrics."""
DIRECTIONS: dict[str, Direction] = {
    "persistence": "higher_is_better", "latency_ms": "lower_is_better",
    "dissatisfied": "lower_is_better", "error_rate": "lower_is_better",
}


def run_scenario(name: str, cfg: SimConfig, canaries: int, seed: int, chunk: int = 100) -> list[Row]:
    policy = bench_policy(cfg.budget)
    mdes = {m.name: m.mde for m in policy.metrics}
    level = {"persistence": cfg.persistence, "latency_ms": LAT_MEAN_MS,
             "dissatisfied": cfg.dissatisfied, "error_rate": cfg.error_rate}
    rng = np.random.default_rng(seed)
    first: dict[str, list[IntArr]] = {k: [] for k in ("ours", "kayenta", "kayenta_fixed", "flagger")}
    ours_any_rollback, ours_codes = [], []
    for start in range(0, canaries, chunk):
        c = min(chunk, canaries - start)
        stable = simulate_arm(rng, cfg, c)
        canary = simulate_arm(rng, cfg, c, **SCENARIOS[name])
        code, tick = ours_by_tick(stable, canary, cfg, policy)
        first["ours"].append(tick)
        ours_codes.append(np.where(tick >= 0, code[np.arange(c), np.maximum(tick, 0)], 0))
        ours_any_rollback.append(baselines.first_true(code == -1))
        iv_s, iv_c = interval_values(stable, cfg), interval_values(canary, cfg)
        first["kayenta"].append(baselines.kayenta_sequential(iv_s, iv_c, DIRECTIONS))
        first["kayenta_fixed"].append(baselines.kayenta_fixed(iv_s, iv_c, DIRECTIONS))
        thresholds = flagger_thresholds(iv_s, level, mdes)
        first["flagger"].append(baselines.flagger(iv_c, thresholds, DIRECTIONS))
    rows = []
    for judge_name, ticks in first.items():
        t = np.concatenate(ticks)
        promote_rate = None
        if judge_name == "ours":
            codes = np.concatenate(ours_codes)
            promote_rate = float((codes == 1).mean())
            if name == "A/A":
                t = np.concatenate(ours_any_rollback)
            else:
                t = np.where(codes == -1, t, -1)
        rolled = t >= 0
        users = (t[rolled] + 1) * cfg.users_per_tick
        rows.append(Row(name, judge_name, float(rolled.mean()),
                        float(np.median(users)) if users.size else float("nan"), promote_rate))
    return rows


def flagger_thresholds(stable_intervals: dict[str, Arr], level: dict[str, float],
                       mdes: dict[str, float]) -> dict[str, float]:
    """Thresholds as a careful operator would set them: at the baseline level moved by the MDE in
    the bad direction, or beyond stable's own 1st/99th percentile interval value if that is
    further out (so a healthy canary rarely fails a check)."""
    out = {}
    for k, direction in DIRECTIONS.items():
        if direction == "higher_is_better":
            out[k] = min(level[k] - mdes[k], float(np.quantile(stable_intervals[k], 0.01)))
        else:
            out[k] = max(level[k] + mdes[k], float(np.quantile(stable_intervals[k], 0.99)))
    return out


LABEL = {"ours": "ours (mSPRT, user-clustered)", "kayenta": "Kayenta-style MW, every interval",
         "kayenta_fixed": "Kayenta-style MW, fixed horizon", "flagger": "Flagger-style threshold x5"}


def table(rows: list[Row], cfg: SimConfig) -> str:
    lines = [f"budget {cfg.budget} users per arm ({cfg.ticks} ticks x {cfg.users_per_tick} users); "
             "rollback rate = false rollbacks in A/A, detection otherwise",
             f"{'scenario':20s} {'judge':34s} {'rollback':>9s} {'median users':>13s} {'promoted':>9s}"]
    for r in rows:
        promoted = "" if r.promote_rate is None else f"{r.promote_rate:9.1%}"
        med = "-" if np.isnan(r.median_users) else f"{r.median_users:,.0f}"
        lines.append(f"{r.scenario:20s} {LABEL[r.judge]:34s} {r.rollback_rate:9.1%} {med:>13s} {promoted}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="rtrl bench judge", description=__doc__.split("\n")[0])
    ap.add_argument("--canaries", type=int, default=1000, help="canaries per scenario (default 1000)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--ticks", type=int, default=SimConfig.ticks)
    ap.add_argument("--users-per-tick", type=int, default=SimConfig.users_per_tick)
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = ap.parse_args(argv)
    if args.canaries < 1 or args.ticks < 1 or args.users_per_tick < 1:
        ap.error("--canaries, --ticks and --users-per-tick must be at least 1")
    cfg = SimConfig(ticks=args.ticks, users_per_tick=args.users_per_tick)
    t0 = time.perf_counter()
    rows: list[Row] = []
    for i, name in enumerate(SCENARIOS):
        rows += run_scenario(name, cfg, args.canaries, args.seed + i)
    elapsed = time.perf_counter() - t0
    ours = {r.scenario: r for r in rows if r.judge == "ours"}
    fixed = {r.scenario: r for r in rows if r.judge == "kayenta_fixed"}
    policy = bench_policy(cfg.budget)
    targets = {
        "false_rollback_at_most_alpha": ours["A/A"].rollback_rate <= policy.alpha,
        "detects_95pct_at_mde": min(ours["persistence -MDE"].rollback_rate,
                                    ours["latency +MDE"].rollback_rate) >= 0.95,
        "half_the_samples_of_fixed_at_2x_mde": all(
            ours[s].median_users <= 0.5 * cfg.budget for s in ("persistence -2xMDE", "latency +2xMDE")),
    }
    kayenta_aa = next(r.rollback_rate for r in rows if r.scenario == "A/A" and r.judge == "kayenta")
    ratios: dict[str, float] = {
        "false_rollback_ours_over_kayenta_every_interval": ours["A/A"].rollback_rate / max(kayenta_aa, 1e-9),
        **{f"users_ours_over_fixed_{s}": ours[s].median_users / fixed[s].median_users
           for s in ("persistence -2xMDE", "latency +2xMDE")},
    }
    if args.json:
        print(json.dumps({"config": asdict(cfg), "canaries": args.canaries, "seed": args.seed,
                          "seconds": elapsed, "rows": [asdict(r) for r in rows], "targets": targets,
                          "ratios": ratios,
                          "fixed_horizon_users": {k: v.median_users for k, v in fixed.items()}}, indent=2))
    else:
        print(table(rows, cfg))
        print(f"\nA/A false rollbacks: ours {ours['A/A'].rollback_rate:.1%} vs Kayenta-style "
              f"every interval {kayenta_aa:.1%}")
        for s in ("persistence -2xMDE", "latency +2xMDE"):
            print(f"{s}: ours needs {ratios[f'users_ours_over_fixed_{s}']:.2f}x the users of the "
                  "fixed-horizon judge (median)")
        print(f"{args.canaries} canaries per scenario, seed {args.seed}, {elapsed:.1f} s")
        for k, v in targets.items():
            print(f"target {k}: {'met' if v else 'MISSED'}")
    return 0
