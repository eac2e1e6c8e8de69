"""Operator commands go through the same state machine and ledger as automatic decisions."""

from __future__ import annotations

import itertools

from deployer.adapters.memory import FakeWorld
from deployer.ledger import TAG_DECIDED_BY, TAG_DECISION, TAG_OUTCOME
from deployer.status import CanaryPolicy, Command, Phase

POLICY = CanaryPolicy(steps=(0.01, 0.05), bake_s=60, max_duration_s=3600)
_ids = itertools.count()


def cmd(kind: str, version: str | None = None, by: str = "alice") -> Command:
    return Command(id=f"c{next(_ids)}", kind=kind, by=by, version=version)  # type: ignore[arg-type]


def world() -> FakeWorld:
    w = FakeWorld(policy=POLICY)
    w.register("1", alias="champion")
    w.register("2", alias="candidate")
    return w


def result(w: FakeWorld) -> str:
    return w.status.handled[-1][1]


def test_manual_promote_of_the_running_canary_is_recorded_as_the_operator() -> None:
    w = world()
    w.tick(), w.tick()
    w.tick(commands=(cmd("promote", "2"),))
    assert w.phases[-1] == "succeeded" and result(w) == "promoting v2"
    assert w.registry.aliases == {"champion": "2", "previous": "1"}
    tags = w.registry.tags["2"]
    assert tags[TAG_DECIDED_BY] == "alice" and tags[TAG_DECISION] == "promote"
    (run_,) = w.ledger.runs.values()
    assert run_.tags[TAG_DECIDED_BY] == "alice" and run_.closed


def test_manual_rollback_of_the_running_canary() -> None:
    w = world()
    w.tick(), w.tick()
    w.tick(commands=(cmd("rollback", by="bob"),))
    assert w.status.phase == Phase.ROLLED_BACK and w.routing.weight == 0.0
    assert w.registry.tags["2"][TAG_DECIDED_BY] == "bob"
    assert "rolled back by hand by bob" in w.registry.tags["2"]["rtrl.decision.reason"]


def test_promoting_another_version_during_a_canary_is_rejected() -> None:
    w = world()
    w.register("3")
    w.tick(), w.tick()
    w.tick(commands=(cmd("promote", "3"),))
    assert result(w).startswith("rejected: the canary of v2 is in progress")
    assert w.status.phase == Phase.PROGRESSING


def test_rollback_to_during_a_canary_is_rejected() -> None:
    w = world()
    w.tick()
    w.tick(commands=(cmd("rollback", "1"),))
    assert result(w).startswith("rejected") and w.status.phase == Phase.PROGRESSING


def test_manual_promote_when_idle_needs_a_passed_gate() -> None:
    w = FakeWorld(policy=POLICY)
    w.register("1", alias="champion")
    w.register("2", gate="fail")
    w.register("3")
    w.tick(commands=(cmd("promote", "2"),))
    assert "gate result fail" in result(w) and w.registry.aliases == {"champion": "1"}
    w.tick(commands=(cmd("promote", "1"),))
    assert "already the champion" in result(w)
    w.tick(commands=(cmd("promote", "3"),))
    assert w.status.phase == Phase.SUCCEEDED and w.status.kind == "manual_promote"
    assert w.registry.aliases == {"champion": "3", "previous": "1"}
    assert w.routing.keys["stable_version"] == "3"
    (run_,) = w.ledger.runs.values()
    assert run_.tags[TAG_DECISION] == "promote" and run_.tags[TAG_DECIDED_BY] == "alice"


def test_rollback_of_the_champion_to_previous_when_no_canary_runs() -> None:
    w = world()
    w.tick(), w.tick(), w.tick(commands=(cmd("promote", "2"),))
    assert w.registry.aliases == {"champion": "2", "previous": "1"}
    w.tick(commands=(cmd("rollback", by="carol"),))
    assert w.status.phase == Phase.ROLLED_BACK and w.status.kind == "manual_rollback"
    assert w.registry.aliases == {"champion": "1", "previous": "2"}
    assert w.routing.keys["stable_version"] == "1"
    assert w.registry.tags["2"][TAG_OUTCOME] == "rolled_back"
    assert w.registry.tags["2"][TAG_DECIDED_BY] == "carol"
    assert len(w.ledger.runs) == 2


def test_rollback_without_previous_or_canary_is_rejected() -> None:
    w = FakeWorld(policy=POLICY)
    w.register("1", alias="champion")
    w.tick(commands=(cmd("rollback"),))
    assert result(w).startswith("rejected: no canary in progress and no previous")


def test_pause_and_resume_are_noted_in_the_ledger_and_idempotent() -> None:
    w = world()
    w.tick(), w.tick()
    pause = cmd("pause")
    w.tick("continue", commands=(pause,))
    assert w.status.paused and result(w) == "paused"
    (run_,) = w.ledger.runs.values()
    assert run_.tags[f"rtrl.operator.{pause.id}"] == "paused by alice"
    w.tick("continue", commands=(cmd("pause"),))
    assert result(w) == "already paused" and w.routing.weight == 0.01
    w.tick("continue", commands=(cmd("resume"),))
    assert not w.status.paused and w.routing.weight == 0.05


def test_a_command_replayed_after_a_crash_is_handled_once() -> None:
    w = FakeWorld(policy=POLICY)
    w.register("1", alias="champion")
    w.register("2")
    promote = cmd("promote", "2")
    w.tick(commands=(promote,))
    w.tick(commands=(promote,))
    assert len(w.ledger.runs) == 1 and [h[0] for h in w.status.handled] == [promote.id]


def test_paused_controller_does_not_start_a_new_canary() -> None:
    w = world()
    w.tick(commands=(cmd("pause"),))
    assert w.status.phase == Phase.IDLE and "paused" in w.status.note
    w.tick(commands=(cmd("resume"),))
    assert w.status.phase == Phase.PENDING
