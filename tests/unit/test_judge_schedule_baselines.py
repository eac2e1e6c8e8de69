"""The Kayenta- and Flagger-style baselines of ``rtrl bench judge --schedule --baselines``
(bench/judge_schedule_baselines.py): interval values against their plain definitions, the
checks' directions, and whole canaries on the fixed schedule."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sps

from bench.judge_schedule import fixed_horizon_users
from bench.judge_schedule_baselines import (
    MDES,
    flagger_fails,
    flagger_threshold,
    kayenta_fails,
    run_baseline,
    value,
)
from bench.judge_schedule_run import users_ratio
from rollback.types import JudgePolicy, RequestOutcome

pytestmark = pytest.mark.unit


def outcome(latency: float, persistence: float | None, dissatisfied: int) -> RequestOutcome:
    return RequestOutcome(user_key="u", reward=0.0, latency_ms=latency, persistence=persistence,
                          accepted=persistence is not None, dissatisfied=dissatisfied,
                          completion_kind="edit", completion_tokens=10, ts=0.0)


def test_interval_values_are_the_plain_means_of_the_records_that_carry_them() -> None:
    outs = [outcome(100.0, 0.5, 0), outcome(300.0, None, 2), outcome(200.0, 1.0, 0)]
    assert value(outs, "latency_ms") == 200.0
    assert value(outs, "persistence") == 0.75  # the record without an accepted edit carries none
    assert value(outs, "dissatisfied") == pytest.approx(1 / 3)  # any follow-up counts once
    assert math.isnan(value([outcome(1.0, None, 0)], "persistence"))


def test_flagger_thresholds_sit_an_mde_out_or_beyond_stables_own_spread() -> None:
    steady = [0.60] * 50
    assert flagger_threshold(steady, "persistence") == pytest.approx(0.60 - MDES["persistence"])
    spread = list(np.linspace(0.4, 0.8, 101))
    assert flagger_threshold(spread, "persistence") == pytest.approx(np.quantile(spread, 0.01))
    latency = [500.0] * 20
    assert flagger_threshold(latency, "latency_ms") == 500.0 + MDES["latency_ms"]
    assert flagger_fails(700.0, latency, "latency_ms") and not flagger_fails(550.0, latency, "latency_ms")
    assert flagger_fails(0.1, steady, "persistence") and not flagger_fails(0.9, steady, "persistence")
    assert not flagger_fails(float("nan"), steady, "persistence")  # an empty interval is skipped
    assert not flagger_fails(0.1, steady[:2], "persistence")  # no baseline yet


def test_the_mann_whitney_check_fails_only_a_canary_worse_in_the_metrics_direction() -> None:
    rng = np.random.default_rng(1)
    stable = list(rng.normal(500.0, 10.0, 30))
    slower = list(rng.normal(560.0, 10.0, 30))
    faster = list(rng.normal(440.0, 10.0, 30))
    assert kayenta_fails(stable, slower, "latency_ms")
    assert not kayenta_fails(stable, faster, "latency_ms")
    kept = list(rng.normal(0.60, 0.02, 30))
    assert kayenta_fails(kept, list(rng.normal(0.50, 0.02, 30)), "persistence")  # lower is worse here
    assert not kayenta_fails(kept, list(rng.normal(0.70, 0.02, 30)), "persistence")
    assert not kayenta_fails(stable[:2], slower[:2], "latency_ms")  # too few intervals to test


@pytest.mark.parametrize("kind", ["kayenta", "kayenta_fixed", "flagger"])
def test_whole_canaries_end_on_the_fixed_schedule(kind: str) -> None:
    bad = [run_baseline(kind, "latency +2 MDE", seed, 300.0, 60.0) for seed in range(3)]
    assert all(r.outcome == "rolled_back" for r in bad), [r.outcome for r in bad]
    assert all(0 < r.hours <= 40 / 60 + 1e-9 and r.canary_users > 0 for r in bad)
    healthy = run_baseline(kind, "A/A, drift", 7, 300.0, 60.0)
    assert healthy.outcome in ("promoted", "rolled_back")
    if healthy.outcome == "promoted":
        assert healthy.hours == pytest.approx(40 / 60)


def test_the_fixed_horizon_is_sized_for_one_mde_at_95_percent_power() -> None:
    policy = JudgePolicy()
    a = policy.alpha_per_test()
    reference = (sps.norm.ppf(1 - a) + sps.norm.ppf(0.95)) ** 2 * 0.09 / 0.03 ** 2
    assert fixed_horizon_users(0.09, "persistence", policy) == math.ceil(reference)
    assert fixed_horizon_users(4 * 0.09, "persistence", policy) > 3.9 * reference  # var up, users up
    shape = "persistence -2 MDE, Zipf"
    r = users_ratio({shape: {"ours": {"median_users_to_rollback": 300.0, "median_var_per_user": 0.09}}},
                    shape)  # type: ignore[arg-type]
    assert r is not None and r["fixed_horizon"] == math.ceil(reference)
    assert r["ratio"] == 300.0 / r["fixed_horizon"]
    assert users_ratio({"s": {"ours": {"median_users_to_rollback": None}}}, "s") is None  # type: ignore[dict-item]
