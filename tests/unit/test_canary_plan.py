"""The canary plan (rollback/plan.py): users each primary metric needs, and when they come.

References are written out here from the formulas (the mixture confidence sequence's radius
for a normal estimate), and the users a plan asks for are checked against the real judge on
simulated A/A canaries drawn by a generator of its own."""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import pytest

from rollback.judge import judge
from rollback.plan import (
    POWER,
    MetricPlan,
    _warning,
    clearing_variance,
    plan_canary,
    time_to_users,
    users_needed,
)
from rollback.types import (
    CohortData,
    DetectorPolicy,
    GuardrailPolicy,
    JudgePolicy,
    MetricSpec,
    RequestOutcome,
)


def reference_radius(v: float, tau: float, alpha: float) -> float:
    # Robbins' normal mixture: reject when the mixture likelihood ratio exceeds 1/alpha
    t2 = tau * tau
    return math.sqrt(v * (v + t2) / t2 * (2 * math.log(1 / alpha) + math.log((v + t2) / v)))


@pytest.mark.parametrize(("margin", "tau", "alpha", "power"),
                         [(0.03, 0.03, 0.004, 0.8), (50.0, 50.0, 0.002, 0.9), (0.02, 0.04, 0.05, 0.5)])
def test_the_clearing_variance_is_where_radius_plus_power_term_meets_the_margin(
        margin: float, tau: float, alpha: float, power: float) -> None:
    v = clearing_variance(margin, tau, alpha, power)
    z = NormalDist().inv_cdf(power)
    at = reference_radius(v, tau, alpha) + z * math.sqrt(v)
    assert at == pytest.approx(margin, rel=1e-6)
    assert reference_radius(v * 1.01, tau, alpha) + z * math.sqrt(v * 1.01) > margin


def test_planned_users_give_the_stated_power_for_a_normal_estimate() -> None:
    margin, tau, alpha, sigma2 = 0.03, 0.03, 0.004, 0.2
    m = users_needed(sigma2, margin, tau, alpha)
    rng = np.random.default_rng(5)
    var = sigma2 / m
    est = rng.normal(0.0, math.sqrt(var), 200_000)
    cleared = (est - reference_radius(var, tau, alpha) > -margin).mean()
    assert cleared == pytest.approx(POWER, abs=0.01)
    fewer = sigma2 / (m * 0.7)
    assert (est * math.sqrt(fewer / var) - reference_radius(fewer, tau, alpha) > -margin).mean() < 0.6


def test_time_to_users_follows_the_ramp() -> None:
    steps, bake = (0.01, 0.05, 0.25, 0.5), 600.0
    # 10 new users/s: 60 canary users on step 1, 300 on step 2, 1,500 on step 3, then 5/s
    assert time_to_users(50, 0, 10.0, steps, 0, 0.0, bake) == pytest.approx(500.0)
    assert time_to_users(200, 0, 10.0, steps, 0, 0.0, bake) == pytest.approx(600 + 140 / 0.5)
    assert time_to_users(2_860, 0, 10.0, steps, 0, 0.0, bake) == pytest.approx(1800 + 1000 / 5)
    # on step 3 with its bake done: the last step's 5 canary users/s
    assert time_to_users(2_860, 1_860, 10.0, steps, 2, 600.0, bake) == pytest.approx(1000 / 5)
    assert time_to_users(100, 100, 10.0, steps, 1, 0.0, bake) == 0.0
    assert time_to_users(100, 0, 0.0, steps, 1, 0.0, bake) is None


def _arm(rng: np.random.Generator, arm: str, users: int, t0: float, span: float) -> list[RequestOutcome]:
    out = []
    for u in range(users):
        p = rng.beta(6, 4)  # each user's own persistence propensity
        ts = t0 + rng.uniform(0, span)
        for k in range(1 + rng.poisson(1.5)):
            out.append(RequestOutcome(user_key=f"{arm}-{t0}-{u}", reward=0.0, latency_ms=400.0,
                                      persistence=float(rng.random() < p), accepted=True, ts=ts + k))
    return out


def test_a_canary_with_the_planned_users_is_promoted_about_as_often_as_planned() -> None:
    # One primary metric at a 50/50 split: the plan from a first look says how many canary
    # users promotion needs; canaries judged at that many users should be promoted with
    # roughly the plan's power (the plan's model is a normal approximation).
    policy = JudgePolicy(metrics=(MetricSpec("persistence", 0.04),), detectors=DetectorPolicy(enabled=()),
                         guardrails=GuardrailPolicy(max_error_rate=0.5, max_p99_latency_ms=1e9), min_users=50,
                         max_users=100_000)
    rng = np.random.default_rng(77)
    first = judge(CohortData("stable", tuple(_arm(rng, "s", 400, 0, 600))),
                  CohortData("canary", tuple(_arm(rng, "c", 400, 0, 600))), policy, elapsed_s=600)
    plan = plan_canary(first, policy, (0.5,), 0, 600.0, 600.0, bake_s=600.0)
    needed = plan.metrics[0].needed
    assert needed is not None and 400 < needed < 20_000
    promoted = 0
    runs = 60
    for _ in range(runs):
        v = judge(CohortData("stable", tuple(_arm(rng, "s", needed, 0, 600))),
                  CohortData("canary", tuple(_arm(rng, "c", needed, 0, 600))), policy, elapsed_s=600)
        promoted += v.decision.value == "promote"
    assert 0.6 <= promoted / runs <= 0.97
    # half the planned users fall well short
    short = sum(judge(CohortData("stable", tuple(_arm(rng, "s", needed // 2, 0, 600))),
                      CohortData("canary", tuple(_arm(rng, "c", needed // 2, 0, 600))), policy,
                      elapsed_s=600).decision.value == "promote" for _ in range(30))
    assert short / 30 < promoted / runs - 0.15


def test_a_plan_beyond_the_budget_says_what_would_fix_it() -> None:
    policy = JudgePolicy(metrics=(MetricSpec("persistence", 0.005),), detectors=DetectorPolicy(enabled=()),
                         min_users=50, max_duration_s=3600.0)
    rng = np.random.default_rng(3)
    v = judge(CohortData("stable", tuple(_arm(rng, "s", 300, 0, 600))),
              CohortData("canary", tuple(_arm(rng, "c", 60, 0, 600))), policy, elapsed_s=600)
    plan = plan_canary(v, policy, (0.05, 0.25, 0.5), 0, 600.0, 600.0, bake_s=600.0)
    assert plan.users_per_min == pytest.approx(36.0)
    assert plan.eta_s is not None and plan.eta_s > plan.budget_left_s == 3000.0
    assert "persistence needs about" in plan.warning and "wider margin" in plan.warning
    wide = JudgePolicy(metrics=(MetricSpec("persistence", 0.5),), detectors=DetectorPolicy(enabled=()),
                       min_users=50, max_duration_s=3600.0)
    relaxed = plan_canary(judge(CohortData("stable", tuple(_arm(rng, "s", 300, 0, 600))),
                                CohortData("canary", tuple(_arm(rng, "c", 60, 0, 600))), wide,
                                elapsed_s=600), wide, (0.05, 0.25, 0.5), 0, 600.0, 600.0, bake_s=600.0)
    assert relaxed.warning == "" and relaxed.metrics[0].needed == 50  # min_users rules


def test_before_the_canary_has_users_stables_variance_plans_it() -> None:
    policy = JudgePolicy(metrics=(MetricSpec("persistence", 0.03),), detectors=DetectorPolicy(enabled=()),
                         min_users=200)
    rng = np.random.default_rng(11)
    v = judge(CohortData("stable", tuple(_arm(rng, "s", 1000, 0, 600))),
              CohortData("canary", tuple(_arm(rng, "c", 10, 0, 600))), policy, elapsed_s=600)
    assert v.metrics[0].status == "insufficient"
    plan = plan_canary(v, policy, (0.01, 0.05, 0.25, 0.5), 0, 600.0, 600.0, bake_s=600.0)
    mp = plan.metrics[0]
    assert mp.users == 10 and mp.needed is not None and mp.needed > 200 and not mp.decided
    assert mp.eta_s is not None and mp.eta_s > 0


def test_the_warning_names_the_metric_that_is_late_not_one_already_decided() -> None:
    policy = JudgePolicy(max_duration_s=3600.0)
    decided = MetricPlan("latency_ms", 50.0, 900, 900, 0.0, True)
    late = MetricPlan("persistence", 0.03, 900, 9_000, 7_200.0, False)
    text = _warning([decided, late], 7_200.0, 1_800.0, 1.0, policy)
    assert text.startswith("persistence needs about 9,000 canary users")
