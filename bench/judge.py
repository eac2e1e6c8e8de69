"""``rtrl bench judge``: the rollback judge against Kayenta- and Flagger-style judges on simulated
canaries shaped like real traffic, all checked at every tick.

Simulation (per canary): ``ticks`` ticks of ``TICK_S`` seconds; each tick 2 × ``users_per_tick``
new users arrive and are split between the arms by the canary's weight at that tick (a constant
50 % split, or the deployer's ramp 1 → 5 → 25 → 50 %). A user makes their requests in the tick
they arrive: 1 + Poisson(2) (at most 6), or Zipf-distributed (exponent 2, up to 200: a few heavy
users). Users differ: their own edit-persistence propensity (Beta around the cohort's rate, so a
user's requests are correlated), their own latency level (log-normal user effect) on top of a
heavy-tailed request latency (log-normal, or Pareto with shape 1.5), dissatisfied follow-ups,
edits, and failed requests (independent, or in bursts: one user's retries). Drifts shared by both
arms (latency rising over the run, persistence falling along a cycle) are functions of the tick.
Regression scenarios shift the canary's persistence down or its mean latency up by the metric's
MDE or twice it.

Reported per judge and scenario: the share of canaries rolled back (with a 95 % interval), the
median canary users at the rollback, and for ours the share promoted and the median users at the
promotion. For our judge a canary's outcome is its first terminal decision (rollback or
promote); in A/A scenarios the false-rollback rate counts a rollback at ANY tick up to the
budget, even after a promote verdict (the worst case for a deployer that keeps judging).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
from numpy.typing import NDArray
from scipy import stats as sps

from bench.judge_cap import stratified_by_tick
from bench.judge_sim import (
    DIRECTIONS,
    TICK_S,
    Arm,
    SimConfig,
    cohort_at_tick,
    flagger_thresholds,
    interval_values,
    metric_arrays,
    metric_sums,
    simulate_arm,
    true_p99,
)
from rollback import baselines
from rollback.metrics import early_variances
from rollback.stats import (
    exceedance_log_lr,
    mixture_radius,
    ratio_mean_var,
)
from rollback.types import DetectorPolicy, GuardrailPolicy, JudgePolicy, MetricSpec

__all__ = ["SimConfig", "cohort_at_tick", "main", "simulate_arm"]

Arr = NDArray[np.float64]
IntArr = NDArray[np.int64]
BoolArr = NDArray[np.bool_]


def bench_policy(max_users: int, cfg: SimConfig | None = None) -> JudgePolicy:
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
        guardrails=GuardrailPolicy(max_p99_latency_ms=(cfg or SimConfig()).p99_ceiling_ms),
        min_users=200,
        max_users=max_users,
        stratum_s=TICK_S,
    )


# --- our judge, vectorised over canaries and looks (sums per look: bench/judge_sim.py) ---------
def ratio_by_tick(arm: Arm, name: str, cfg: SimConfig) -> tuple[Arr, Arr]:
    """One arm's plain (unstratified, uncapped) cumulative mean and cluster-robust variance at
    every tick, (canaries, ticks): the naive comparison's inputs."""
    s, n = metric_arrays(arm, name)
    cs, cn, cs2, csn, cn2, g = (np.cumsum(x, axis=-1) for x in metric_sums(s, n, None))
    return ratio_mean_var(cs, cn, cs2, csn, cn2, g)


def guard_by_tick(stable: Arm, canary: Arm, policy: JudgePolicy, guardrail: str) -> BoolArr:
    """A guardrail's trips at every look, as rollback.judge.guardrails decides them."""
    g = policy.guardrails
    name, q0 = ("error_rate", g.max_error_rate) if guardrail == "error_rate" else ("p99_slow", 0.01)
    s, n = metric_arrays(canary, name)
    sums = tuple(np.cumsum(x, axis=-1) for x in metric_sums(s, n, None))
    k, total = sums[0], sums[1]
    _, clustered = ratio_mean_var(*sums)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = k / total
        binomial = p * (1 - p) / total
        deff = np.where((k > 0) & (k < total) & np.isfinite(clustered),
                        np.maximum(1.0, clustered / binomial), 1.0)
    log_lr = np.where(total > 0, exceedance_log_lr(k / deff, total / deff, q0), 0.0)
    m_s, m_c, _, _ = stratified_by_tick(stable, canary, name, None)
    diff = m_c - m_s
    plain_s = np.cumsum(metric_arrays(stable, name)[0].sum(-1), -1) / np.maximum(
        np.cumsum(metric_arrays(stable, name)[1].sum(-1), -1), 1)
    diff = np.where(np.isfinite(diff), diff, k / np.maximum(total, 1) - plain_s)
    enough = total >= policy.guardrails.min_requests
    tripped: BoolArr = enough & (log_lr >= math.log(1.0 / policy.alpha_per_test())) & (diff > 0)
    return tripped


def bounds_by_tick(stable: Arm, canary: Arm, cfg: SimConfig, policy: JudgePolicy, name: str,
                   mde: float, early: bool = True) -> tuple[Arr, Arr, Arr, BoolArr]:
    """(estimate, lower, upper, defined) of canary − stable for one metric or detector at every
    look, as rollback.metrics.compare computes them; ``defined`` is False where no interval is
    computed (too few users, or no stratum with two users in each arm). ``early``: a metric,
    whose interval exists from ``rollback_min_users`` on each arm's variance floored by the
    larger per-user variance until ``min_users``; a detector waits for ``min_users``."""
    alpha = min(0.5, 2 * policy.alpha_per_test())
    n_s, n_c = (cfg.cum_users(a).astype(np.float64) for a in ("stable", "canary"))
    users = np.minimum(n_s, n_c)
    m_s, m_c, v_s, v_c = stratified_by_tick(stable, canary, name, policy.user_weight_cap,
                                            policy.tail_cap_quantile)
    est = m_c - m_s
    floor = min(policy.rollback_min_users, policy.min_users) if early else policy.min_users
    with np.errstate(invalid="ignore", divide="ignore"):
        floored = np.add(*early_variances(np.asarray(v_s, np.float64), n_s, np.asarray(v_c, np.float64), n_c))
    var = np.where(users < policy.min_users, floored, v_s + v_c)
    defined = np.isfinite(est) & np.isfinite(var) & (users >= floor)
    r = mixture_radius(np.maximum(var, (mde * 1e-3) ** 2), policy.mixture_scale * mde, alpha)
    return est, est - r, est + r, defined


def ours_by_tick(stable: Arm, canary: Arm, cfg: SimConfig, policy: JudgePolicy) -> tuple[IntArr, IntArr]:
    """(decision code per canary and tick: 0 continue, 1 promote, -1 rollback; first terminal tick).

    The same statistics as rollback.judge.judge (tests/unit/test_judge_bench.py checks they agree).
    """
    enough = np.minimum(cfg.cum_users("stable"), cfg.cum_users("canary")) >= policy.min_users
    worse = np.zeros((stable.n.shape[0], cfg.ticks), dtype=bool)
    ok = np.ones_like(worse)
    for spec in policy.metrics:
        _, lower, upper, defined = bounds_by_tick(stable, canary, cfg, policy, spec.name, spec.mde)
        if spec.direction == "higher_is_better":
            worse |= defined & (upper < 0)
            inferior_possible = ~defined | (lower <= -spec.mde)
        else:
            worse |= defined & (lower > 0)
            inferior_possible = ~defined | (upper >= spec.mde)
        if spec.primary:
            ok &= ~inferior_possible
    fired = np.zeros_like(worse)
    holding = np.zeros_like(worse)
    if "edit_rate" in policy.detectors.enabled:
        tol = policy.detectors.edit_rate_drop
        est, _, upper, defined = bounds_by_tick(stable, canary, cfg, policy, "edit_rate", tol, early=False)
        fired = defined & (upper < -tol)
        holding = defined & (est < -tol) & ~fired
    guard = (guard_by_tick(stable, canary, policy, "error_rate")
             | guard_by_tick(stable, canary, policy, "p99_latency_ms"))
    rollback = guard | worse | fired
    promote = ok & ~holding & enough & ~rollback
    code = np.where(rollback, -1, np.where(promote, 1, 0)).astype(np.int64)
    return code, baselines.first_true(code != 0)


# --- the benchmark ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Scenario:
    config: dict[str, Any] = field(default_factory=dict)
    """SimConfig fields that differ from the base configuration."""
    shifts: dict[str, float] = field(default_factory=dict)
    """The canary's shifts (persistence_shift, latency_shift_ms, edit_shift); none for A/A."""
    power: bool = False
    """Detection at one MDE must reach 95 %."""
    speed: bool = False
    """Users at the decision must stay within half the fixed-horizon judge's."""

    @property
    def aa(self) -> bool:
        return not self.shifts


RAMPED = {"schedule": "ramp"}
ZIPF = {"requests": "zipf", "users_per_tick": 210}
"""Zipf users carry less information each (61 % make one request): at the same MDE they need
about 1.3x the users of the Poisson traffic (docs/judge.md), hence the larger budget."""
SCENARIOS: dict[str, Scenario] = {
    "A/A": Scenario(),
    "persistence -MDE": Scenario(shifts={"persistence_shift": -0.03}, power=True),
    "persistence -2xMDE": Scenario(shifts={"persistence_shift": -0.06}, speed=True),
    "latency +MDE": Scenario(shifts={"latency_shift_ms": 50.0}, power=True),
    "latency +2xMDE": Scenario(shifts={"latency_shift_ms": 100.0}, speed=True),
    "edit rate -10 pts": Scenario(shifts={"edit_shift": -0.10}),
    "A/A ramp": Scenario(RAMPED),
    "A/A ramp, latency drift +30%": Scenario({**RAMPED, "latency_drift": 0.3}),
    "A/A ramp, persistence cycle": Scenario({**RAMPED, "persistence_cycle": 0.05}),
    "A/A ramp, bursty errors": Scenario({**RAMPED, "error_rate": 0.001, "error_burst": 10.0}),
    "A/A ramp, Pareto latency": Scenario({**RAMPED, "latency": "pareto", "p99_ceiling_ms": -1.2}),
    "A/A Zipf users": Scenario(ZIPF),
    "persistence -MDE, Zipf": Scenario(ZIPF, {"persistence_shift": -0.03}, power=True),
    "persistence -2xMDE, Zipf": Scenario(ZIPF, {"persistence_shift": -0.06}, speed=True),
    "latency +MDE, Zipf": Scenario(ZIPF, {"latency_shift_ms": 50.0}, power=True),
    "latency +2xMDE, Zipf": Scenario(ZIPF, {"latency_shift_ms": 100.0}, speed=True),
}
"""Shifts of the canary and traffic shapes. "edit rate -10 pts" is reward hacking (fewer edits,
same persistence): only our judge watches behaviour rates. A negative ``p99_ceiling_ms`` means
that multiple of the true p99 (a ceiling a healthy canary sits just under)."""
def scenario_config(name: str, base: SimConfig) -> SimConfig:
    overrides = dict(SCENARIOS[name].config)
    if "users_per_tick" in overrides:  # scaled with the base, so --users-per-tick still applies
        overrides["users_per_tick"] = round(overrides["users_per_tick"] * base.users_per_tick
                                            / SimConfig.users_per_tick)
    cfg = replace(base, **overrides)
    if cfg.p99_ceiling_ms < 0:
        cfg = replace(cfg, p99_ceiling_ms=-cfg.p99_ceiling_ms * true_p99(cfg))
    return cfg


@dataclass
class Row:
    scenario: str
    judge: str
    rollback_rate: float
    median_users: float
    promote_rate: float | None = None
    rollback_ci: tuple[float, float] = (0.0, 1.0)
    """95 % Clopper-Pearson interval of the rollback rate."""
    median_users_promoted: float | None = None


def clopper_pearson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    a = (1 - level) / 2
    lo = float(sps.beta.ppf(a, k, n - k + 1)) if k > 0 else 0.0
    hi = float(sps.beta.ppf(1 - a, k + 1, n - k)) if k < n else 1.0
    return lo, hi


def run_scenario(name: str, base: SimConfig, canaries: int, seed: int, chunk: int = 50,
                 with_baselines: bool = True) -> list[Row]:
    scenario = SCENARIOS[name]
    cfg = scenario_config(name, base)
    policy = bench_policy(cfg.budget, cfg)
    mdes = {m.name: m.mde for m in policy.metrics}
    level = {"persistence": cfg.persistence, "latency_ms": cfg.latency_mean(),
             "dissatisfied": cfg.dissatisfied, "error_rate": cfg.error_rate}
    rng = np.random.default_rng(seed)
    first: dict[str, list[IntArr]] = {k: [] for k in ("ours", "kayenta", "kayenta_fixed", "flagger")}
    any_rollback, codes, promoted_at = [], [], []
    for start in range(0, canaries, chunk):
        c = min(chunk, canaries - start)
        stable = simulate_arm(rng, cfg, c, arm="stable")
        canary = simulate_arm(rng, cfg, c, arm="canary", **scenario.shifts)
        code, tick = ours_by_tick(stable, canary, cfg, policy)
        first["ours"].append(tick)
        codes.append(np.where(tick >= 0, code[np.arange(c), np.maximum(tick, 0)], 0))
        any_rollback.append(baselines.first_true(code == -1))
        promoted_at.append(baselines.first_true(code == 1))
        if not with_baselines:
            continue
        iv_s, iv_c = interval_values(stable), interval_values(canary)
        first["kayenta"].append(baselines.kayenta_sequential(iv_s, iv_c, DIRECTIONS))
        first["kayenta_fixed"].append(baselines.kayenta_fixed(iv_s, iv_c, DIRECTIONS))
        thresholds = flagger_thresholds(iv_s, level, mdes)
        first["flagger"].append(baselines.flagger(iv_c, thresholds, DIRECTIONS))
    cum_canary = cfg.cum_users("canary")
    rows = []
    for judge_name, ticks in first.items():
        if not ticks:
            continue
        t = np.concatenate(ticks)
        promote_rate = users_promoted = None
        if judge_name == "ours":
            first_codes = np.concatenate(codes)
            promote_rate = float((first_codes == 1).mean())
            t = np.concatenate(any_rollback) if scenario.aa else np.where(first_codes == -1, t, -1)
            p_at = np.concatenate(promoted_at)
            p_at = p_at[p_at >= 0]
            users_promoted = float(np.median(cum_canary[p_at])) if p_at.size else float("nan")
        rolled = t >= 0
        users = cum_canary[t[rolled]]
        rows.append(Row(name, judge_name, float(rolled.mean()),
                        float(np.median(users)) if users.size else float("nan"), promote_rate,
                        clopper_pearson(int(rolled.sum()), rolled.size), users_promoted))
    return rows


LABEL = {"ours": "ours (stratified mSPRT)", "kayenta": "Kayenta-style MW, every interval",
         "kayenta_fixed": "Kayenta-style MW, fixed horizon", "flagger": "Flagger-style threshold x5"}


def table(rows: list[Row], base: SimConfig) -> str:
    lines = [f"{base.ticks} ticks of {TICK_S / 60:.0f} min, {2 * base.users_per_tick} new users per tick; "
             "rollback = false rollbacks in A/A scenarios, detection otherwise (95% interval); "
             "users = canary users at the decision (median)",
             f"{'scenario':30s} {'judge':32s} {'rollback':>7s} {'95% interval':>15s} {'users':>7s} "
             f"{'promoted':>8s} {'at users':>8s}"]
    for r in rows:
        promoted = "" if r.promote_rate is None else f"{r.promote_rate:8.1%}"
        at = "" if r.median_users_promoted is None or math.isnan(r.median_users_promoted) \
            else f"{r.median_users_promoted:8,.0f}"
        med = "-" if math.isnan(r.median_users) else f"{r.median_users:,.0f}"
        ci = f"{r.rollback_ci[0]:.1%}-{r.rollback_ci[1]:.1%}"
        lines.append(f"{r.scenario:30s} {LABEL[r.judge]:32s} {r.rollback_rate:7.1%} {ci:>15s} {med:>7s} "
                     f"{promoted:>8s} {at:>8s}")
    return "\n".join(lines)


def targets(rows: list[Row], base: SimConfig, alpha: float) -> dict[str, bool]:
    ours = {r.scenario: r for r in rows if r.judge == "ours"}
    fixed = {r.scenario: r for r in rows if r.judge == "kayenta_fixed"}
    aa = [ours[s] for s in ours if SCENARIOS[s].aa]
    power = [ours[s] for s in ours if SCENARIOS[s].power]
    speed = [s for s in ours if SCENARIOS[s].speed]
    out = {
        "false_rollback_at_most_alpha_in_every_aa": all(r.rollback_rate <= alpha for r in aa),
        "detects_95pct_at_mde_in_every_power_scenario": all(r.rollback_rate >= 0.95 for r in power),
        "half_the_users_of_fixed_horizon_at_2x_mde": all(
            ours[s].median_users <= 0.5 * fixed[s].median_users for s in speed),
    }
    return out if aa and power and speed else {}


def main(argv: list[str]) -> int:
    if "--scale" in argv:  # the judge's cost per tick as a window grows (bench/judge_scale.py)
        from bench import judge_scale

        return judge_scale.main([a for a in argv if a != "--scale"])
    if "--schedule" in argv:  # whole canaries on the deployer's schedule (bench/judge_schedule_run.py)
        from bench import judge_schedule_run

        return judge_schedule_run.main([a for a in argv if a != "--schedule"])
    ap = argparse.ArgumentParser(prog="rtrl bench judge", description=__doc__.split("\n")[0],
                                 epilog="--scale: the judge's CPU per tick up to 1M requests "
                                        "(rtrl bench judge --scale --help); --schedule: whole "
                                        "canaries on the deployer's schedule and an independent "
                                        "generator (rtrl bench judge --schedule --help)")
    ap.add_argument("--canaries", type=int, default=1000, help="canaries per scenario (default 1000)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--ticks", type=int, default=SimConfig.ticks)
    ap.add_argument("--users-per-tick", type=int, default=SimConfig.users_per_tick)
    ap.add_argument("--scenario", action="append", choices=sorted(SCENARIOS), metavar="NAME",
                    help="run only this scenario (repeatable; default: all)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = ap.parse_args(argv)
    if args.canaries < 1 or args.ticks < 1 or args.users_per_tick < 1:
        ap.error("--canaries, --ticks and --users-per-tick must be at least 1")
    base = SimConfig(ticks=args.ticks, users_per_tick=args.users_per_tick)
    names = args.scenario or list(SCENARIOS)
    t0 = time.perf_counter()
    rows: list[Row] = []
    for name in names:
        t1 = time.perf_counter()
        rows += run_scenario(name, base, args.canaries, args.seed + list(SCENARIOS).index(name))
        if not args.json:
            print(f"  {name}: {time.perf_counter() - t1:.0f} s", flush=True)
    elapsed = time.perf_counter() - t0
    alpha = bench_policy(base.budget).alpha
    met = targets(rows, base, alpha)
    ours = {r.scenario: r for r in rows if r.judge == "ours"}
    fixed = {r.scenario: r for r in rows if r.judge == "kayenta_fixed"}
    ratios = {f"users_ours_over_fixed_{s}": ours[s].median_users / fixed[s].median_users
              for s in ours if SCENARIOS[s].speed}
    if args.json:
        print(json.dumps({"config": asdict(base), "canaries": args.canaries, "seed": args.seed,
                          "seconds": elapsed, "rows": [asdict(r) for r in rows], "targets": met,
                          "ratios": ratios}, indent=2))
        return 0
    print(table(rows, base))
    print()
    for s, r in ratios.items():
        print(f"{s.removeprefix('users_ours_over_fixed_')}: ours needs {r:.2f}x the users of the "
              "fixed-horizon judge (median)")
    print(f"{args.canaries} canaries per scenario, seed {args.seed}, {elapsed:.1f} s")
    for k, v in met.items():
        print(f"target {k}: {'met' if v else 'MISSED'}")
    return 0
