"""The canary state machine driven tick by tick against in-memory fakes (Flagger style):
each test feeds verdicts and asserts the phase sequence and what the world looks like."""

from __future__ import annotations

import json

import pytest

from deployer.actions import SetWeight, apply_actions
from deployer.adapters.memory import FakeWorld
from deployer.canary import next_state
from deployer.ledger import TAG_DECIDED_BY, TAG_DECISION, TAG_OUTCOME, TAG_REASON
from deployer.status import CanaryPolicy, CanaryStatus, Judgement, Phase

POLICY = CanaryPolicy(steps=(0.01, 0.05, 0.25, 0.5), bake_s=60, max_duration_s=3600, max_errors=3)


def world(candidate: str | None = "2", gate: str = "pass") -> FakeWorld:
    w = FakeWorld(policy=POLICY)
    w.register("1", alias="champion")
    if candidate:
        w.register(candidate, gate=gate, alias="candidate")
    return w


def run(w: FakeWorld, *decisions: str | None) -> list[str]:
    start = len(w.phases)
    for d in decisions:
        w.tick(d)
    return w.phases[start:]


def test_better_candidate_steps_through_every_weight_then_is_promoted() -> None:
    w = world()
    weights = []
    phases = []
    for d in [None, None, "continue", "continue", "continue", "promote"]:
        phases += run(w, d)
        weights.append(w.routing.weight)
    assert phases == ["pending", "progressing", "progressing", "progressing", "progressing",
                      "promoting", "succeeded"]
    assert weights == [0.0, 0.01, 0.05, 0.25, 0.5, 0.0]
    assert w.registry.aliases == {"champion": "2", "previous": "1"}
    assert w.routing.keys["stable_version"] == "2" and "canary_version" not in w.routing.keys
    tags = w.registry.tags["2"]
    assert tags[TAG_OUTCOME] == "promoted" and tags[TAG_DECISION] == "promote"
    assert tags[TAG_DECIDED_BY] == "controller" and "judge said promote" in tags[TAG_REASON]
    (run_,) = w.ledger.runs.values()
    assert run_.closed and run_.tags[TAG_DECISION] == "promote"
    assert sorted(run_.metrics["canary.weight"]) == [1, 2, 3, 4]
    assert run_.metrics["canary.weight"][4] == 0.5 and run_.metrics["judge.verdict"][4] == 1.0


def test_the_start_of_every_weight_step_is_kept_for_the_judges_strata() -> None:
    w = world()
    starts = []
    for d in [None, None, "continue", "continue", "continue"]:
        before = w.status.weight
        run(w, d)
        if w.status.weight != before:
            starts.append(w.now)
    assert w.status.weight == 0.5 and len(starts) == 4
    assert w.status.step_times == tuple(starts)  # 1%, 5%, 25%, 50%
    restored = CanaryStatus.from_json(json.loads(json.dumps(w.status.to_json())))
    assert restored.step_times == w.status.step_times


def test_ledger_run_names_the_candidates_data_reward_spec_and_training_run() -> None:
    w = world()
    w.registry.set_tags("2", {"rtrl.parent_version": "1", "rtrl.reward_spec_version": "default-3",
                              "rtrl.window": '{"topic": "rewards", "records": 1200}', "rtrl.run_id": "abc"})
    run(w, None)
    (run_,) = w.ledger.runs.values()
    assert run_.tags["rtrl.candidate.parent_version"] == "1"
    assert run_.tags["rtrl.candidate.reward_spec_version"] == "default-3"
    assert run_.tags["rtrl.candidate.window"].startswith('{"topic"')
    assert run_.tags["rtrl.candidate.run_id"] == "abc" and "rtrl.candidate.kind" not in run_.tags


def test_promote_verdict_before_the_last_step_only_keeps_stepping() -> None:
    w = world()
    assert run(w, None, None, "promote", "promote") == ["pending"] + ["progressing"] * 3
    assert w.routing.weight == 0.25 and w.registry.aliases["champion"] == "1"


def test_promotion_waits_for_the_bake_on_the_last_step() -> None:
    w = world()
    run(w, None, None, "continue", "continue", "continue")
    assert w.status.step == 3
    w.tick("promote", dt=30)  # only half the bake time on the last step
    assert w.status.phase == Phase.PROGRESSING
    w.tick("promote", dt=30)
    assert w.status.phase == Phase.SUCCEEDED


def test_worse_candidate_is_rolled_back_at_once_with_weight_zero() -> None:
    w = world()
    assert run(w, None, None, "continue", "rollback") == [
        "pending", "progressing", "progressing", "rolling_back", "rolled_back"]
    assert w.routing.weight == 0.0 and "canary_version" not in w.routing.keys
    assert w.routing.keys["stable_version"] == "1"
    assert w.registry.aliases == {"champion": "1"}
    tags = w.registry.tags["2"]
    assert tags[TAG_OUTCOME] == "rolled_back" and tags[TAG_DECISION] == "rollback"
    assert "judge said rollback" in tags[TAG_REASON]
    (run_,) = w.ledger.runs.values()
    assert run_.closed and run_.tags[TAG_OUTCOME] == "rolled_back"
    assert run_.summary["decided_by"] == "controller"


def test_decision_tick_sets_weight_zero_before_anything_else() -> None:
    w = world()
    run(w, None, None, "continue")
    obs = w.observe(Judgement("rollback", ("guardrail: error rate 9% > 5%",)))
    status, actions = next_state(w.status, obs, POLICY)
    assert status.phase == Phase.ROLLING_BACK and SetWeight(0.0) in actions


def test_guardrail_rolls_back_even_while_paused() -> None:
    w = world()
    run(w, None, None)
    w.status = CanaryStatus.from_json({**w.status.to_json(), "paused": True})
    assert run(w, "rollback") == ["rolling_back", "rolled_back"]


def test_inconclusive_verdict_aborts_and_never_promotes() -> None:
    w = world()
    assert run(w, None, None, "continue", "inconclusive")[-2:] == ["rolling_back", "aborted"]
    assert w.registry.aliases == {"champion": "1"}
    assert w.registry.tags["2"][TAG_OUTCOME] == "aborted"
    assert w.registry.tags["2"][TAG_DECISION] == "abort"


def test_budget_spent_without_a_decision_aborts() -> None:
    w = world()
    run(w, None, None, "continue", "continue", "continue")
    w.tick("continue", dt=3600)
    assert w.status.phase == Phase.ABORTED and "budget" in w.status.reason


def test_repeated_observation_errors_abort_but_one_error_only_holds() -> None:
    w = world()
    run(w, None, None)
    w.tick(error="rewards topic unreachable")
    assert w.status.phase == Phase.PROGRESSING and w.status.errors == 1 and w.status.step == 0
    w.tick("continue")
    assert w.status.errors == 0 and w.status.note == ""
    for _ in range(3):
        w.tick(error="rewards topic unreachable")
    assert w.status.phase == Phase.ABORTED and "3 consecutive" in w.status.reason


def test_pause_holds_the_weight_and_resume_steps_on() -> None:
    w = world()
    run(w, None, None)
    w.status = CanaryStatus.from_json({**w.status.to_json(), "paused": True})
    assert run(w, "continue", "continue", "promote") == ["progressing"] * 3
    assert w.routing.weight == 0.01
    w.status = CanaryStatus.from_json({**w.status.to_json(), "paused": False})
    run(w, "continue")
    assert w.routing.weight == 0.05


def test_gate_failure_or_missing_gate_never_deploys() -> None:
    for gate in ("fail", ""):
        w = world(gate=gate)
        assert run(w, None, None) == ["idle", "idle"]
        assert "not deployed" in w.status.note and w.routing.writes == 0


def test_no_candidate_stays_idle_and_a_later_candidate_starts() -> None:
    w = world(candidate=None)
    assert run(w, None, None) == ["idle", "idle"]
    w.register("2", alias="candidate")
    assert run(w, None) == ["pending"]


def test_after_a_rollback_the_next_candidate_gets_its_own_canary() -> None:
    w = world()
    run(w, None, None, "rollback")
    w.register("3", alias="candidate")
    assert run(w, None, None) == ["pending", "progressing"]
    assert w.status.candidate == "3" and len(w.ledger.runs) == 2
    assert w.routing.keys["salt"] == w.status.canary_id  # a fresh salt per canary


def test_candidate_alias_moved_outside_the_controller_aborts() -> None:
    w = world()
    run(w, None, None)
    w.register("3", alias="candidate")
    run(w, "continue")
    assert w.status.phase == Phase.ABORTED and "outside the controller" in w.status.reason
    assert w.registry.aliases["candidate"] == "3"  # the newer candidate is left alone


def test_restart_from_persisted_status_resumes_the_same_phase_and_step() -> None:
    w = world()
    run(w, None, None, "continue")
    saved = json.dumps(w.status.to_json())
    fresh = FakeWorld(policy=POLICY, registry=w.registry, routing=w.routing, ledger=w.ledger,
                      status=CanaryStatus.from_json(json.loads(saved)), now=w.now)
    assert fresh.status == w.status
    assert run(fresh, "continue", "continue", "promote") == [
        "progressing", "progressing", "promoting", "succeeded"]


@pytest.mark.parametrize("crash_at", ["decision", "finishing"])
def test_crash_between_apply_and_persist_is_harmless(crash_at: str) -> None:
    """The controller persists after the decision and again after finishing it; a crash
    right before either persist replays the same, idempotent actions."""
    w = world()
    run(w, None, None, "continue", "continue", "continue")
    w.now += 60
    decided, actions = next_state(w.status, w.observe(Judgement("promote")), POLICY)
    apply_actions(actions, w.routing, w.registry, w.ledger)
    if crash_at == "finishing":
        w.status = decided  # the decision was persisted ...
        _, more = next_state(decided, w.observe(), POLICY)
        apply_actions(more, w.routing, w.registry, w.ledger)  # ... its finishing was not
    w.tick("promote", dt=0)
    assert w.status.phase == Phase.SUCCEEDED
    assert w.registry.aliases == {"champion": "2", "previous": "1"}
    assert w.registry.tags["2"][TAG_OUTCOME] == "promoted"
    (run_,) = w.ledger.runs.values()
    assert sorted(run_.metrics["canary.weight"]) == [1, 2, 3, 4]
    assert run_.closed and run_.tags[TAG_DECISION] == "promote"


def test_status_json_round_trip() -> None:
    w = world()
    run(w, None, None, "continue")
    data = json.loads(json.dumps(w.status.to_json()))
    assert CanaryStatus.from_json(data) == w.status
    assert CanaryStatus.from_json({"phase": "idle", "unknown_field": 1}) == CanaryStatus()


@pytest.mark.parametrize("steps", [(), (0.5, 0.25), (0.1, 1.0), (0.0, 0.5)])
def test_policy_rejects_bad_steps(steps: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="steps"):
        CanaryPolicy(steps=steps)
