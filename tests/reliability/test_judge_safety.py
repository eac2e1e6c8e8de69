"""Statistical safety of the rollback judge on traffic shaped like production: simulated A/A
canaries (the judge must roll back at most alpha of them, whether the canary ramps up under a
drift shared by both arms, errors come in one user's bursts, latency is Pareto-tailed or a few
users make most requests) and A/B canaries shifted by exactly the minimum detectable effect (it
must catch at least 95%, with Poisson or Zipf users), through the same vectorised judge as
`rtrl bench judge` (tests/unit/test_judge_bench.py checks it decides exactly as
rollback.judge does)."""

from __future__ import annotations

import time

import pytest

from bench.judge import SCENARIOS, SimConfig, bench_policy, run_scenario
from tests.reliability import scale

SEED = 7


@pytest.mark.timeout(1800)
def test_false_rollbacks_at_most_alpha_and_detection_at_the_mde() -> None:
    n = scale.current().judge_canaries
    cfg = SimConfig()
    alpha = bench_policy(cfg.budget).alpha
    t0 = time.perf_counter()
    checked = [s for s, sc in SCENARIOS.items() if sc.aa or sc.power]
    rates = {}
    for name in checked:
        [ours] = run_scenario(name, cfg, n, SEED + list(SCENARIOS).index(name), with_baselines=False)
        rates[name] = ours.rollback_rate
    scale.record("judge_safety", {
        "canaries_per_scenario": n, "alpha": alpha, "seed": SEED,
        **{f"rollback_rate {name}": rate for name, rate in rates.items()},
        "seconds": round(time.perf_counter() - t0, 1),
    })
    for name in checked:
        if SCENARIOS[name].aa:
            assert rates[name] <= alpha, f"{name}: false rollbacks {rates[name]:.2%} > alpha {alpha:.0%}"
        else:
            assert rates[name] >= 0.95, f"{name}: detected {rates[name]:.1%} < 95%"
