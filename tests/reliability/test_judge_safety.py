"""Statistical safety of the rollback judge: simulated A/A canaries (the judge must roll back
at most alpha of them) and A/B canaries shifted by exactly the minimum detectable effect
(it must catch at least 95%), through the same vectorised judge as `rtrl bench judge`
(tests/unit/test_judge_bench.py checks it decides exactly as rollback.judge does)."""

from __future__ import annotations

import time

import pytest

from bench.judge import SimConfig, bench_policy, run_scenario
from tests.reliability import scale

SEED = 7


@pytest.mark.timeout(900)
def test_false_rollbacks_at_most_alpha_and_detection_at_the_mde() -> None:
    n = scale.current().judge_canaries
    cfg = SimConfig()
    alpha = bench_policy(cfg.budget).alpha
    t0 = time.perf_counter()
    rates = {}
    for i, name in enumerate(("A/A", "persistence -MDE", "latency +MDE")):
        ours = next(r for r in run_scenario(name, cfg, n, SEED + i) if r.judge == "ours")
        rates[name] = ours.rollback_rate
    scale.record("judge_safety", {
        "canaries_per_scenario": n, "alpha": alpha, "seed": SEED,
        "false_rollback_rate_aa": rates["A/A"],
        "detection_rate_persistence_mde": rates["persistence -MDE"],
        "detection_rate_latency_mde": rates["latency +MDE"],
        "seconds": round(time.perf_counter() - t0, 1),
    })
    assert rates["A/A"] <= alpha, f"A/A false rollbacks {rates['A/A']:.2%} > alpha {alpha:.0%}"
    for name in ("persistence -MDE", "latency +MDE"):
        assert rates[name] >= 0.95, f"{name}: detected {rates[name]:.1%} < 95%"
