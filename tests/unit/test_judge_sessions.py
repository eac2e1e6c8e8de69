"""The judge's per-session metrics (completion rate, turns per completed session, share of
sessions with an invalid tool call): counted once per session from the credited reward
records, clustered by user, and checked against plain sums over the sessions."""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pytest

from ingest.events import CreditedSession, ModelRef, RewardRecord
from rollback.columns import outcome_from_reward
from rollback.judge import judge
from rollback.metrics import session_metrics
from rollback.types import CohortData, Decision, DetectorPolicy, JudgePolicy, MetricSpec, RequestOutcome

NOW = datetime(2026, 12, 5, 12, 0, tzinfo=UTC)


@dataclass(frozen=True)
class Sess:
    user: str
    turns: int
    status: str
    invalid: int


def records(s: Sess, sid: str, arm: str) -> list[RewardRecord]:
    """The session's reward records as the session stage writes them: one per turn, the first
    the lead."""
    return [RewardRecord(
        request_id=f"{sid}-r{t}", served_event_id=f"{sid}-e{t}", session_id=sid, user_key=s.user,
        served_ts=NOW, closed_ts=NOW, model=ModelRef(name="m", version="1"), arm=arm,  # type: ignore[arg-type]
        prompt_tokens=[1], completion_tokens=[2], behavior_logprobs=[-1.0], latency_ms=10.0,
        completion_kind="tool_call", reward=0.0, components={}, reward_spec_version="agent-v1",
        session_credit=CreditedSession(turn=t, turns=s.turns, status=s.status,  # type: ignore[arg-type]
                                       invalid_tool_calls=s.invalid, lead=t == 0))
        for t in range(s.turns)]


def cohort(arm: str, sessions: list[Sess], plain: int = 0) -> CohortData:
    outs = [outcome_from_reward(r) for i, s in enumerate(sessions) for r in records(s, f"{arm}-{i}", arm)]
    outs += [RequestOutcome(user_key=f"plain-{i}", reward=0.0, latency_ms=10.0) for i in range(plain)]
    return CohortData(arm, tuple(outs))  # type: ignore[arg-type]


def plain(sessions: list[Sess]) -> dict[str, float]:
    """The three figures by their definitions, over the sessions (not the records)."""
    done = [s for s in sessions if s.status == "completed"]
    return {"session_completion": len(done) / len(sessions),
            "turns_per_completed": sum(s.turns for s in done) / len(done),
            "session_invalid_tool_rate": sum(s.invalid > 0 for s in sessions) / len(sessions)}


def generate(rng: random.Random, users: int, p_done: float, mean_turns: float) -> list[Sess]:
    out = []
    for u in range(users):
        for _ in range(rng.randint(1, 4)):  # users with several sessions: clustered by user
            turns = max(1, round(rng.expovariate(1 / mean_turns)))
            failed = rng.choice(["abandoned", "handed_back", "timed_out"])
            status = "completed" if rng.random() < p_done else failed
            out.append(Sess(f"u{u}", turns, status, rng.choice([0, 0, 0, 1, 3])))
    return out


POLICY = JudgePolicy(metrics=session_metrics(), min_users=20, user_weight_cap=None,
                     detectors=DetectorPolicy(enabled=()))


def test_a_credited_record_carries_its_session_once() -> None:
    lead, other = records(Sess("u", 2, "completed", 1), "s", "stable")
    o, p = outcome_from_reward(lead), outcome_from_reward(other)
    assert (o.session_turns, o.session_completed, o.session_invalid) == (2, True, True)
    assert (p.session_turns, p.session_completed, p.session_invalid) == (0, False, False)


def test_the_figures_are_the_plain_ratios_over_sessions() -> None:
    rng = random.Random(7)
    stable = generate(rng, 60, 0.6, 3.0)
    canary = generate(rng, 50, 0.5, 4.0)
    v = judge(cohort("stable", stable, plain=30), cohort("canary", canary), POLICY)
    got = {e.metric: (e.stable_mean, e.canary_mean) for e in v.metrics}
    for name, want in plain(stable).items():
        assert got[name][0] == pytest.approx(want), name
    for name, want in plain(canary).items():
        assert got[name][1] == pytest.approx(want), name
    # users without sessions (the plain requests) do not count as session users
    users = {e.metric: (e.n_stable, e.n_canary) for e in v.metrics}
    assert users["session_completion"] == (60, 50)


def test_a_canary_that_completes_fewer_sessions_is_rolled_back_and_an_equal_one_is_not() -> None:
    rng = random.Random(11)
    stable = generate(rng, 400, 0.7, 3.0)
    worse = judge(cohort("stable", stable), cohort("canary", generate(rng, 400, 0.45, 3.0)), POLICY)
    assert worse.decision == Decision.ROLLBACK
    assert any(r.startswith("Session completion rate") and "worse" in r for r in worse.reasons)
    same = judge(cohort("stable", stable), cohort("canary", generate(rng, 400, 0.7, 3.0)), POLICY)
    assert same.decision != Decision.ROLLBACK


def test_no_sessions_is_insufficient_not_an_error() -> None:
    v = judge(cohort("stable", [], plain=300), cohort("canary", [], plain=300),
              JudgePolicy(metrics=(MetricSpec("session_completion", 0.05),), min_users=20,
                          detectors=POLICY.detectors))
    assert [e.status for e in v.metrics] == ["insufficient"]


def test_the_deployer_judges_sessions_only_under_a_session_spec() -> None:
    from services.settings.model import Settings
    from services.wiring.deployer import judge_policy_for

    agent = Path(__file__).resolve().parents[2] / "ingest" / "reward" / "specs" / "agent.toml"
    names = [m.name for m in judge_policy_for(Settings(reward_spec=agent)).metrics]
    assert names[-3:] == ["session_completion", "turns_per_completed", "session_invalid_tool_rate"]
    assert not {"session_completion"} & {m.name for m in judge_policy_for(Settings()).metrics}


def test_the_champion_against_the_holdout_reports_the_session_metrics() -> None:
    """deployer.holdout.measure (the deployer's holdout monitor, the demo report) gives the
    per-session effects, champion minus holdout, with the plain definitions' values."""
    from deployer.cohorts import HoldoutWindow
    from deployer.holdout import measure

    rng = random.Random(11)
    base, champ = generate(rng, 80, 0.3, 5.0), generate(rng, 80, 0.5, 4.0)
    window = HoldoutWindow("1", "2", NOW.timestamp() - 60)
    for arm, version, sessions in (("holdout", "1", base), ("stable", "2", champ)):
        for i, s in enumerate(sessions):
            window.add_all(r.model_copy(update={"model": ModelRef(name="m", version=version)})
                           for r in records(s, f"{arm}-{i}", arm))
    found = {e.metric: e for e in measure(window, POLICY, NOW.timestamp()).effects}
    assert set(found) == {"session_completion", "turns_per_completed", "session_invalid_tool_rate"}
    for name, value in plain(base).items():
        assert found[name].holdout_mean == pytest.approx(value), name
    for name, value in plain(champ).items():
        assert found[name].champion_mean == pytest.approx(value), name
    done = found["session_completion"]
    assert done.lower < done.estimate < done.upper and done.estimate == pytest.approx(
        plain(champ)["session_completion"] - plain(base)["session_completion"])
