"""A clear regression is rolled back from ``rollback_min_users`` users per arm, before the
promote floor (``min_users``); in that early phase each arm's variance is floored by the larger
per-user variance, and nothing but "worse" is decided."""

from __future__ import annotations

import random

import pytest

from rollback.judge import judge
from rollback.metrics import compare, early_variances
from rollback.types import CohortData, Decision, JudgePolicy, RequestOutcome


def _arm(arm: str, users: int, *, seed: int, latency: float = 400.0) -> CohortData:
    rng = random.Random(seed)
    out = []
    for u in range(users):
        for _ in range(rng.randint(1, 4)):
            acc = rng.random() < 0.7
            out.append(RequestOutcome(
                user_key=f"{arm}-{u}", reward=rng.gauss(0.3, 0.5),
                latency_ms=latency * rng.lognormvariate(0, 0.3),
                persistence=float(rng.random() < 0.6) if acc else None, accepted=acc,
                dissatisfied=int(rng.random() < 0.05), completion_kind="edit",
                completion_tokens=rng.randint(20, 60)))
    return CohortData(arm, tuple(out))  # type: ignore[arg-type]


POLICY = JudgePolicy(min_users=200, rollback_min_users=60, max_users=50_000)


def test_early_variances_against_the_plain_rule() -> None:
    # stable: 1,000 users at a per-user variance of 10; canary: 100 users at 5 (steady by chance)
    v_s, v_c = early_variances(0.01, 1000, 0.05, 100)
    assert v_s == pytest.approx(0.01)  # its own per-user variance is the larger one
    assert v_c == pytest.approx(10 / 100)  # stable's per-user variance over the canary's users
    # a canary noisier than stable keeps its own variance, and stable takes the canary's
    assert early_variances(0.01, 1000, 0.5, 100) == pytest.approx((50 / 1000, 0.5))


def test_a_clear_regression_rolls_back_before_the_promote_floor() -> None:
    v = judge(_arm("stable", 2000, seed=1), _arm("canary", 120, seed=2, latency=1200.0), POLICY)
    assert v.decision == Decision.ROLLBACK
    assert any(r.startswith("Mean latency") and "worse" in r for r in v.reasons), v.reasons
    assert v.users_canary < POLICY.min_users


def test_a_healthy_canary_waits_for_the_promote_floor_and_decides_nothing_else() -> None:
    v = judge(_arm("stable", 2000, seed=1), _arm("canary", 120, seed=2), POLICY)
    assert v.decision == Decision.CONTINUE
    assert any("Waiting for 200 users per arm" in r for r in v.reasons)
    assert {e.status for e in v.metrics} == {"insufficient"}


def test_below_the_rollback_floor_only_guardrails_act() -> None:
    v = judge(_arm("stable", 2000, seed=1), _arm("canary", 40, seed=2, latency=1200.0), POLICY)
    assert v.decision == Decision.CONTINUE
    assert all(e.status == "insufficient" and e.ci_lower == -float("inf") for e in v.metrics)


def test_a_small_arm_that_looks_steady_by_chance_does_not_narrow_the_interval() -> None:
    kw = dict(direction="lower_is_better", mde=0.1, tau=0.1, alpha=0.001, state={})
    stable, canary = (0.0, 1e-4, 1000, 0), (0.05, 1e-6, 100, 0)
    # on its own variance the canary's +0.05 is five standard errors: worse
    assert compare("latency_ms", stable, canary, min_n=100, **kw).status == "worse"  # type: ignore[arg-type]
    # early, it is judged on stable's per-user variance: not shown worse, and nothing else decided
    early = compare("latency_ms", stable, canary, min_n=200, min_n_worse=50, **kw)  # type: ignore[arg-type]
    assert early.status == "insufficient"
    assert early.ci_upper - early.ci_lower > 2 * 0.05
    assert (early.var_stable, early.var_canary) == (1e-4, 1e-6)  # the arms' own variances, as seen


def test_the_rollback_floor_is_capped_at_the_promote_floor_and_must_be_positive() -> None:
    # min_users below the rollback floor: the promote floor governs both (the old behaviour)
    v = judge(_arm("stable", 2000, seed=1), _arm("canary", 45, seed=2, latency=1200.0),
              JudgePolicy(min_users=40, max_users=50_000))
    assert v.decision == Decision.ROLLBACK
    with pytest.raises(ValueError, match="rollback_min_users"):
        JudgePolicy(rollback_min_users=0)
