"""Ledger content and cohort building (pure), checked on hand-computed cases."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

import pytest

from deployer import ledger
from deployer.adapters.canary_metrics import export_judgement, export_metrics, reason_kind
from deployer.cohorts import CohortWindow, HoldoutWindow, cohort_metrics, judgement, summary
from deployer.status import CanaryStatus, Judgement, Observations, Phase
from ingest.contracts import prometheus as m
from ingest.events import ModelRef, RewardRecord
from rollback.judge import judge
from rollback.plan import plan_canary
from rollback.types import CohortData, JudgePolicy, RequestOutcome

T0 = datetime(2027, 1, 15, 8, 0, tzinfo=UTC)


def record(rid: str, arm: str, version: str, served: datetime, reward: float = 1.0,
           **kw: object) -> RewardRecord:
    return RewardRecord(
        request_id=rid, served_event_id=f"{rid}-s", session_id="s", user_key=kw.pop("user", f"u{rid}"),  # type: ignore[arg-type]
        served_ts=served, closed_ts=served, model=ModelRef(name="p", version=version), arm=arm,  # type: ignore[arg-type]
        prompt_tokens=[1], completion_tokens=[2, 3], behavior_logprobs=[-0.1, -0.2],
        latency_ms=kw.pop("latency_ms", 100.0), reward=reward, components={}, reward_spec_version="t",  # type: ignore[arg-type]
        **kw,  # type: ignore[arg-type]
    )


def test_canary_id_names_kind_version_and_utc_time() -> None:
    assert ledger.canary_id("canary", "7", T0.timestamp()) == "canary-v7-20270115T080000Z"
    assert ledger.iso(T0.timestamp()) == "2027-01-15T08:00:00Z"


def test_decision_tags_mirror_the_outcome() -> None:
    tags = ledger.decision_tags("rolled_back", "judge: worse", "controller", T0.timestamp())
    assert tags == {
        "rtrl.canary.outcome": "rolled_back", "rtrl.decision": "rollback",
        "rtrl.decision.reason": "judge: worse", "rtrl.decided_by": "controller",
        "rtrl.decided_at": "2027-01-15T08:00:00Z",
    }
    assert ledger.version_tags("c1", "aborted", "x", "bob", 0)["rtrl.decision"] == "abort"
    with pytest.raises(ValueError, match="unknown outcome"):
        ledger.decision_tags("maybe", "", "", 0)


def test_long_reasons_are_clipped_to_the_tag_limit() -> None:
    tags = ledger.decision_tags("promoted", "x" * 10_000, "controller", 0)
    assert len(tags["rtrl.decision.reason"]) == ledger.MAX_TAG_CHARS
    assert tags["rtrl.decision.reason"].endswith("...")


def test_step_metrics_prefix_and_drop_non_finite() -> None:
    got = ledger.step_metrics(0.05, "rollback", {"stable.n": 3.0, "canary.x": math.nan},
                              {"reward.p_value": 0.01, "reward.ci_upper": math.inf}, paused=True)
    assert got == {"canary.weight": 0.05, "canary.paused": 1.0, "judge.verdict": -1.0,
                   "cohort.stable.n": 3.0, "judge.reward.p_value": 0.01}


def test_window_keeps_only_this_canarys_versions_arms_and_time_once() -> None:
    w = CohortWindow(stable_version="1", canary_version="2", started_at=T0.timestamp())
    later = T0 + timedelta(seconds=5)
    assert w.add(record("a", "stable", "1", later))
    assert w.add(record("b", "canary", "2", later))
    assert not w.add(record("a", "stable", "1", later))  # the same request twice
    assert not w.add(record("c", "canary", "1", later))  # canary arm, wrong version
    assert not w.add(record("d", "stable", "2", later))  # stable arm, wrong version
    assert not w.add(record("e", "canary", "2", T0 - timedelta(seconds=1)))  # before the start
    assert not w.add(record("f", "holdout", "1", later))  # the long-term holdout's users
    assert not w.add(record("g", "holdout", "2", later))
    stable, canary = w.cohorts(requests={"canary": 10}, errors={"canary": 1})
    assert (len(stable.outcomes), len(canary.outcomes)) == (1, 1)
    assert canary.requests == 10 and canary.errors == 1 and stable.requests == 0


@pytest.mark.parametrize(("arm", "version", "served_s", "side"), [
    ("holdout", "1", 5, "stable"),  # the pinned version's users: the baseline
    ("stable", "4", 5, "canary"),  # the champion's users: the treatment
    ("holdout", "4", 5, None), ("stable", "1", 5, None), ("canary", "5", 5, None), ("canary", "4", 5, None),
    ("holdout", "1", -1, None), ("stable", "4", -1, None),  # before the comparison started
])
def test_holdout_window_sides(arm: str, version: str, served_s: int, side: str | None) -> None:
    w = HoldoutWindow(stable_version="1", canary_version="4", started_at=T0.timestamp())
    rec = record("r", arm, version, T0 + timedelta(seconds=served_s))
    assert w.side(rec) == side and w.add(rec) is (side is not None)
    base, champ = w.cohorts()
    assert (len(base.outcomes), len(champ.outcomes)) == ((side == "stable") * 1, (side == "canary") * 1)


def test_cohort_summary_by_hand() -> None:
    outs = (
        RequestOutcome("u1", reward=1.0, latency_ms=100, accepted=True, persistence=0.5, tool_calls=2,
                       invalid_tool_calls=1),
        RequestOutcome("u1", reward=0.0, latency_ms=300, accepted=False, dissatisfied=1,
                       completion_kind="question"),
        RequestOutcome("u2", reward=0.5, latency_ms=200),
    )
    s = summary(CohortData("canary", outs, requests=4, errors=1))
    assert s["n"] == 3 and s["users"] == 2
    assert s["reward_mean"] == pytest.approx(0.5) and s["latency_mean_ms"] == pytest.approx(200)
    assert s["latency_p95_ms"] == pytest.approx(290)  # numpy's linear interpolation: 200 + 0.9*100
    # acceptance among edits with accept/reject feedback: the question's rejection is no edit's
    assert s["acceptance"] == 1.0 and s["persistence"] == 0.5
    assert s["dissatisfied_rate"] == pytest.approx(1 / 3) and s["edit_rate"] == pytest.approx(2 / 3)
    assert s["invalid_tool_rate"] == 0.5 and s["error_rate"] == 0.25
    assert summary(CohortData("stable")) == {"n": 0.0, "users": 0.0}
    both = cohort_metrics(CohortData("stable"), CohortData("canary", outs))
    assert both["stable.n"] == 0 and both["canary.n"] == 3


def test_judgement_carries_decision_state_and_flat_stats() -> None:
    outs = tuple(RequestOutcome(f"u{i}", reward=1.0, latency_ms=100.0) for i in range(5))
    verdict = judge(CohortData("stable", outs), CohortData("canary", outs), JudgePolicy(), None)
    j = judgement(verdict)
    assert j.decision == verdict.decision.value and j.state == verdict.state
    assert j.stats["users.stable"] == 5 and "guardrail.error_rate.tripped" in j.stats
    assert "reward.p_value" in j.stats


def test_the_plan_reaches_the_ledger_stats_and_its_own_gauges() -> None:
    outs = tuple(RequestOutcome(f"u{i}", reward=float(i % 3), latency_ms=100.0 + i, ts=float(i))
                 for i in range(300))
    policy = JudgePolicy(min_users=20)
    verdict = judge(CohortData("stable", outs), CohortData("canary", outs[:60]), policy, None,
                    elapsed_s=600.0)
    plan = plan_canary(verdict, policy, (0.1, 0.5), 0, 300.0, 600.0, bake_s=600.0)
    j = judgement(verdict, plan=plan)
    assert j.plan == plan.to_doc() and j.stats["plan.users_per_min"] == pytest.approx(36.0)
    known = [mp for mp in plan.metrics if mp.needed is not None]
    assert known and all(j.stats[f"plan.{mp.metric}.needed"] == mp.needed for mp in known)
    step = ledger.step_metrics(0.1, j.decision, {}, j.stats, False)
    assert step["judge.plan.users_per_min"] == pytest.approx(36.0)
    export_judgement(j)
    mp = known[0]
    assert m.CANARY_PLAN.labels(mp.metric, "needed")._value.get() == mp.needed
    assert m.CANARY_PLAN.labels(mp.metric, "users")._value.get() == mp.users
    eta = -1.0 if plan.eta_s is None else plan.eta_s
    assert m.CANARY_DECISION_ETA._value.get() == pytest.approx(eta)


def test_end_of_canary_metrics_count_once_with_low_cardinality_labels() -> None:
    before = CanaryStatus(phase=Phase.PROGRESSING, canary_id="c1")
    after = CanaryStatus(phase=Phase.ROLLED_BACK, canary_id="c1", outcome="rolled_back",
                         reason="judge: canary worse: guardrail error rate", decided_by="controller")
    obs = Observations(now=10.0, champion="1", candidate=None,
                       judgement=Judgement("rollback", stats={"detector.edit_rate.fired": 1.0}))
    rollbacks = m.CANARY_ROLLBACKS.labels("guardrail", "controller")
    detections = m.HACKING_DETECTIONS.labels("edit_rate")
    r0, d0 = rollbacks._value.get(), detections._value.get()
    export_metrics(before, after, obs)
    export_metrics(after, after, Observations(now=11.0, champion="1", candidate=None))
    assert rollbacks._value.get() == r0 + 1 and detections._value.get() == d0 + 1
    assert m.CANARY_PHASE.labels("rolled_back")._value.get() == 1.0
    assert m.CANARY_PHASE.labels("progressing")._value.get() == 0.0
    assert reason_kind(CanaryStatus(decided_by="alice", reason="guardrail")) == "operator"
    assert reason_kind(CanaryStatus(reason="inconclusive: no decision within the 60s budget")) == "budget"


def test_judge_mde_overrides_and_rejects_unknown_metrics() -> None:
    from services.settings.deployer import DeployerSettings
    from services.wiring.deployer import judge_policy

    policy = judge_policy(DeployerSettings(judge_mde={"reward": 0.2}, judge_alpha=0.05))
    mde = {s.name: s.mde for s in policy.metrics}
    assert mde["reward"] == 0.2 and mde["persistence"] == 0.03 and policy.alpha == 0.05
    with pytest.raises(ValueError, match="unknown metrics"):
        judge_policy(DeployerSettings(judge_mde={"happiness": 1.0}))
    assert not policy.require_improvement
    assert judge_policy(DeployerSettings(judge_require_improvement=True)).require_improvement
