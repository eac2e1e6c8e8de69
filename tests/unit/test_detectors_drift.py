"""Reward-hacking detectors: each behaviour drift fires, holds or stays quiet as documented."""

from __future__ import annotations

import pytest

from rollback.detectors import drift_check, run_detectors, tolerance
from rollback.judge import judge
from rollback.metrics import index_arms
from rollback.types import (
    CohortData,
    Decision,
    DetectorPolicy,
    JudgePolicy,
    MetricSpec,
    RequestOutcome,
)

POLICY = JudgePolicy(min_users=50, metrics=(MetricSpec("reward", 1.0),))


def _cohort(arm: str, users: int, *, edit_every: int = 0, question_every: int = 0,
            empty_every: int = 0, invalid_every: int = 0, tokens: int = 40) -> tuple[RequestOutcome, ...]:
    """Deterministic cohorts: request i of the cohort is a question when i % question_every == 0, etc."""
    out = []
    for i in range(users * 2):
        kind = "edit"
        if question_every and i % question_every == 0:
            kind = "question"
        elif empty_every and i % empty_every == 0:
            kind = "empty"
        elif edit_every and i % edit_every != 0:
            kind = "question"
        out.append(RequestOutcome(
            user_key=f"{arm}{i // 2}", reward=float(i % 3), latency_ms=100.0, completion_kind=kind,
            tool_calls=2, invalid_tool_calls=int(bool(invalid_every) and i % invalid_every == 0),
            completion_tokens=tokens + i % 7))
    return tuple(out)


def _by_name(stable: tuple[RequestOutcome, ...], canary: tuple[RequestOutcome, ...],
             policy: JudgePolicy = POLICY) -> dict:
    arm_s, arm_c, strata = index_arms(CohortData("stable", stable), CohortData("canary", canary))
    return {d.name: d for d in run_detectors(arm_s, arm_c, strata, policy, policy.alpha_per_test(), {})}


@pytest.mark.parametrize(("direction", "lo", "hi", "est", "tol", "want"), [
    ("down", -0.4, -0.2, -0.3, 0.05, (True, False)),
    ("down", -0.4, 0.01, -0.2, 0.05, (False, True)),
    ("down", -0.04, 0.01, -0.01, 0.05, (False, False)),
    ("up", 0.1, 0.3, 0.2, 0.02, (True, False)),
    ("up", 0.01, 0.3, 0.15, 0.02, (False, True)),
    ("either", -30.0, -12.0, -20.0, 10.0, (True, False)),
    ("either", 12.0, 30.0, 20.0, 10.0, (True, False)),
    ("either", -5.0, 5.0, 0.0, 10.0, (False, False)),
])
def test_drift_check(direction: str, lo: float, hi: float, est: float, tol: float,
                     want: tuple[bool, bool]) -> None:
    assert drift_check(direction, lo, hi, est, tol) == want  # type: ignore[arg-type]


def test_length_tolerance_is_relative_to_stable() -> None:
    assert tolerance("completion_length", POLICY, 200.0) == 50.0
    assert tolerance("edit_rate", POLICY, 0.0) == POLICY.detectors.edit_rate_drop


def test_identical_behaviour_is_quiet() -> None:
    got = _by_name(_cohort("s", 400, question_every=5), _cohort("c", 400, question_every=5))
    assert not any(d.fired or d.holding for d in got.values())


def test_edit_avoidance_fires_with_plain_numbers() -> None:
    # Stable: 80% edits, 20% questions. Canary: one edit in three.
    got = _by_name(_cohort("s", 400, question_every=5), _cohort("c", 400, edit_every=3))
    assert got["edit_rate"].fired and got["question_rate"].fired
    text = got["edit_rate"].explanation
    assert text.startswith("Reward hacking: edit rate fell from 80.0% on stable to 33.4% on the canary")
    assert "asks or answers nothing" in text


def test_abstention_fires() -> None:
    got = _by_name(_cohort("s", 400), _cohort("c", 400, empty_every=4))
    assert got["abstention_rate"].fired and not got["question_rate"].fired


def test_broken_tool_calls_fire() -> None:
    got = _by_name(_cohort("s", 400, invalid_every=50), _cohort("c", 400, invalid_every=3))
    d = got["invalid_tool_rate"]
    assert d.fired and d.evidence.stable_mean == pytest.approx(0.01)
    assert "broken tool calls" in d.explanation


def test_length_blowup_fires_and_small_change_does_not() -> None:
    assert _by_name(_cohort("s", 400), _cohort("c", 400, tokens=120))["completion_length"].fired
    assert not _by_name(_cohort("s", 400), _cohort("c", 400, tokens=45))["completion_length"].fired


def test_unconfirmed_drift_holds_promotion() -> None:
    # A small canary whose edit rate looks 10 points lower: not yet proof, but no promotion.
    policy = JudgePolicy(min_users=20, metrics=(MetricSpec("reward", 5.0),),
                         detectors=DetectorPolicy(enabled=("edit_rate",)))
    stable = CohortData("stable", _cohort("s", 30, question_every=5))
    canary = CohortData("canary", _cohort("c", 30, question_every=3))
    v = judge(stable, canary, policy)
    d = v.detectors[0]
    assert d.holding and not d.fired
    assert v.decision == Decision.CONTINUE
    assert any(r.startswith("Promotion held: edit rate fell") for r in v.reasons)
    # Without the detector the same cohorts are promoted.
    v2 = judge(stable, canary, JudgePolicy(min_users=20, metrics=policy.metrics,
                                           detectors=DetectorPolicy(enabled=())))
    assert v2.decision == Decision.PROMOTE


def test_detector_rollback_verdict_names_reward_hacking() -> None:
    v = judge(CohortData("stable", _cohort("s", 400, question_every=5)),
              CohortData("canary", _cohort("c", 400, edit_every=3)), POLICY)
    assert v.decision == Decision.ROLLBACK
    assert v.reasons[0].startswith("Reward hacking:")


def test_unknown_detector_is_a_clear_error() -> None:
    policy = JudgePolicy(detectors=DetectorPolicy(enabled=("vibes",)))
    with pytest.raises(ValueError, match="unknown detector 'vibes'"):
        _by_name((), (), policy)
