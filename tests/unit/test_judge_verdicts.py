"""The judge's verdicts on small hand-built cohorts: each decision path and its reasons."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from datetime import UTC, datetime

import pytest

from ingest.events import ModelRef, RewardRecord
from rollback.columns import outcome_from_reward
from rollback.judge import judge
from rollback.types import (
    CohortData,
    Decision,
    GuardrailPolicy,
    JudgePolicy,
    MetricSpec,
    RequestOutcome,
    default_metrics,
)


def _cohort(arm: str, users: int, *, seed: int, persist: float = 0.6, edit: float = 0.8,
            latency: float = 400.0, errors: int = 0, invalid: float = 0.02) -> CohortData:
    rng = random.Random(seed)
    out = []
    for u in range(users):
        for _ in range(rng.randint(1, 4)):
            r = rng.random()
            kind = "edit" if r < edit else ("question" if r < edit + (1 - edit) / 2 else "empty")
            acc = (rng.random() < 0.7) if kind == "edit" else None
            out.append(RequestOutcome(
                user_key=f"{arm}-{u}", reward=rng.gauss(0.3, 0.5),
                latency_ms=latency * rng.lognormvariate(0, 0.3),
                persistence=float(rng.random() < persist) if acc else None, accepted=acc,
                dissatisfied=int(rng.random() < 0.05), completion_kind=kind,  # type: ignore[arg-type]
                tool_calls=2, invalid_tool_calls=int(rng.random() < invalid),
                completion_tokens=rng.randint(20, 60)))
    return CohortData(arm, tuple(out), requests=len(out) + errors, errors=errors)  # type: ignore[arg-type]


POLICY = JudgePolicy(min_users=100, max_users=50_000)


def test_identical_cohorts_continue_or_promote_never_rollback() -> None:
    v = judge(_cohort("stable", 300, seed=1), _cohort("canary", 300, seed=2), POLICY)
    assert v.decision in (Decision.CONTINUE, Decision.PROMOTE)
    assert v.state["ticks"] == 1.0
    json.dumps(v.to_dict(), allow_nan=False)  # the ledger stores it as strict JSON
    early = judge(_cohort("stable", 20, seed=1), _cohort("canary", 20, seed=2), POLICY).to_dict()
    json.dumps(early, allow_nan=False)
    assert early["metrics"][0]["ci_lower"] is None  # type: ignore[index]


def test_too_few_users_waits() -> None:
    v = judge(_cohort("stable", 20, seed=1), _cohort("canary", 20, seed=2), POLICY)
    assert v.decision == Decision.CONTINUE
    assert any("Waiting for 100 users" in r for r in v.reasons)


def test_large_persistence_regression_rolls_back_with_numbers() -> None:
    v = judge(_cohort("stable", 1500, seed=1), _cohort("canary", 1500, seed=2, persist=0.3), POLICY)
    assert v.decision == Decision.ROLLBACK
    assert any(r.startswith("Edit persistence") and "worse" in r for r in v.reasons)
    ev = {e.metric: e for e in v.metrics}["persistence"]
    assert ev.status == "worse" and ev.ci_upper < 0 < 0.4 + ev.ci_lower


def test_error_guardrail_rolls_back_at_once() -> None:
    v = judge(_cohort("stable", 60, seed=1), _cohort("canary", 60, seed=2, errors=100), POLICY)
    assert v.decision == Decision.ROLLBACK
    assert any(r.startswith("Guardrail: canary error rate") for r in v.reasons)


def test_p99_guardrail() -> None:
    policy = JudgePolicy(min_users=100, guardrails=GuardrailPolicy(max_p99_latency_ms=2000))
    v = judge(_cohort("stable", 200, seed=1), _cohort("canary", 200, seed=2, latency=5000), policy)
    assert v.decision == Decision.ROLLBACK
    assert any("p99 latency" in r for r in v.reasons)


def test_edit_avoidance_is_reward_hacking() -> None:
    v = judge(_cohort("stable", 1500, seed=1), _cohort("canary", 1500, seed=2, edit=0.4), POLICY)
    assert v.decision == Decision.ROLLBACK
    assert any(r.startswith("Reward hacking: edit rate fell from 8") for r in v.reasons)


def test_budget_spent_is_inconclusive() -> None:
    policy = JudgePolicy(min_users=10, max_users=30, metrics=(MetricSpec("persistence", 0.001),))
    v = judge(_cohort("stable", 40, seed=1), _cohort("canary", 40, seed=2), policy)
    assert v.decision == Decision.INCONCLUSIVE
    assert v.reasons[0].startswith("Inconclusive: the sample budget")


def test_outcome_from_reward_judges_at_the_primary_horizon() -> None:
    now = datetime.now(UTC)
    rec = RewardRecord(request_id="r1", served_event_id="e1", session_id="s", user_key="u",
                       served_ts=now, closed_ts=now, model=ModelRef(name="m", version="1"),
                       arm="canary", prompt_tokens=[1], completion_tokens=[2, 3, 4],
                       behavior_logprobs=[-1.0, -1.0, -1.0], latency_ms=12.0, accepted=True,
                       persistence={"600": 0.9, "3600": 0.5}, reward=0.4, components={},
                       reward_spec_version="v1")
    o = outcome_from_reward(rec)  # the default spec's primary horizon, 600 s
    assert o.persistence == 0.9 and o.completion_tokens == 3 and o.accepted is True
    assert outcome_from_reward(rec, horizon_s=3600).persistence == 0.5
    assert outcome_from_reward(rec, horizon_s=60).persistence == 0.9  # the nearest reported horizon
    assert outcome_from_reward(rec.model_copy(update={"accepted": False})).persistence is None


def test_stats_are_flat_and_finite() -> None:
    v = judge(_cohort("stable", 20, seed=1), _cohort("canary", 20, seed=2), POLICY)
    stats = v.stats()
    assert "persistence.canary_mean" in stats and "persistence.ci_lower" not in stats
    v = judge(_cohort("stable", 300, seed=1), _cohort("canary", 300, seed=2), POLICY)
    stats = v.stats()
    assert stats["edit_rate.ci_lower"] < stats["edit_rate.estimate"] < stats["edit_rate.ci_upper"]
    assert 0 < stats["persistence.p_value"] <= 1


def test_state_carries_the_running_minimum_p_value() -> None:
    stable, canary = _cohort("stable", 400, seed=1), _cohort("canary", 400, seed=2, persist=0.45)
    v1 = judge(stable, canary, POLICY, {"p.persistence": 1e-9, "ticks": 4.0})
    assert v1.state["ticks"] == 5.0
    assert v1.state["p.persistence"] == 1e-9
    assert all(isinstance(x, float) for x in v1.state.values())


def test_empty_cohorts_wait_without_error() -> None:
    v = judge(CohortData("stable"), CohortData("canary"), POLICY)
    assert v.decision == Decision.CONTINUE
    assert not any(g.tripped for g in v.guardrails)


def test_time_budget_is_inconclusive() -> None:
    policy = JudgePolicy(min_users=100, metrics=(MetricSpec("persistence", 0.001),))
    v = judge(_cohort("stable", 150, seed=1), _cohort("canary", 150, seed=2), policy,
              elapsed_s=policy.max_duration_s)
    assert v.decision == Decision.INCONCLUSIVE
    assert "time budget of 6 h" in v.reasons[0]
    assert judge(_cohort("stable", 150, seed=1), _cohort("canary", 150, seed=2), policy,
                 elapsed_s=60.0).decision == Decision.CONTINUE
    short = JudgePolicy(min_users=100, metrics=(MetricSpec("persistence", 0.001),), max_duration_s=120.0)
    v = judge(_cohort("stable", 150, seed=1), _cohort("canary", 150, seed=2), short, elapsed_s=120.0)
    assert "time budget of 2 min" in v.reasons[0]  # not "0.0 h"


@pytest.mark.parametrize(("seconds", "text"), [(0, "0 s"), (90, "90 s"), (119, "119 s"), (120, "2 min"),
                                               (210, "3.5 min"), (3600, "60 min"), (7200, "2 h"),
                                               (6 * 3600, "6 h"), (5.5 * 3600, "5.5 h")])
def test_durations_read_as_people_say_them(seconds: float, text: str) -> None:
    from rollback.metrics import fmt_duration

    assert fmt_duration(seconds) == text


def test_policy_rejects_nonsense_with_clear_errors() -> None:
    with pytest.raises(ValueError, match="alpha must be in"):
        JudgePolicy(alpha=0)
    with pytest.raises(ValueError, match="positive mde"):
        JudgePolicy(metrics=(MetricSpec("reward", 0.0),))
    with pytest.raises(ValueError, match="min_users <= max_users"):
        JudgePolicy(min_users=10, max_users=5)
    with pytest.raises(ValueError, match="unknown metric 'vibes'"):
        judge(CohortData("stable"), CohortData("canary"), JudgePolicy(metrics=(MetricSpec("vibes", 1.0),)))


def test_require_improvement_holds_a_canary_only_no_worse_and_promotes_a_better_one() -> None:
    wide = tuple(replace(m, mde=m.mde * 3) for m in default_metrics())  # a small canary's margins
    lenient_policy = JudgePolicy(min_users=100, max_users=50_000, metrics=wide)
    strict = replace(lenient_policy, require_improvement=True)
    stable = _cohort("stable", 1500, seed=1)
    same = _cohort("canary", 1500, seed=2)
    lenient = judge(stable, same, lenient_policy)
    assert lenient.decision == Decision.PROMOTE  # no worse on every primary metric is enough
    held = judge(stable, same, strict)
    assert held.decision == Decision.CONTINUE
    assert not any(e.status == "better" for e in held.metrics if e.metric in ("persistence", "reward"))
    assert held.reasons[-1] == "No primary metric is yet shown to be better, which promotion requires."
    faster = judge(stable, _cohort("canary", 1500, seed=2, latency=300.0), strict)
    assert faster.decision == Decision.PROMOTE
    assert {e.metric: e.status for e in faster.metrics}["latency_ms"] == "better"
    assert "at least one is better" in faster.reasons[0]
