"""The approval gate: a canary the judge would promote waits in awaiting_approval until an
operator approves or rejects it, the judge turns, or the wait times out."""

from __future__ import annotations

import itertools
import json

from deployer.adapters.canary_metrics import reason_kind
from deployer.adapters.memory import FakeWorld
from deployer.ledger import TAG_DECIDED_BY, TAG_DECISION, TAG_REASON
from deployer.status import CanaryPolicy, CanaryStatus, Command, Phase

POLICY = CanaryPolicy(steps=(0.01, 0.05), bake_s=60, max_duration_s=3600, approval_required=True,
                      approval_timeout_s=600)
_ids = itertools.count()


def cmd(kind: str, version: str | None = None, by: str = "alice", reason: str = "") -> Command:
    return Command(id=f"a{next(_ids)}", kind=kind, by=by, version=version, reason=reason)  # type: ignore[arg-type]


def awaiting(policy: CanaryPolicy = POLICY) -> FakeWorld:
    """A world whose canary of v2 just passed the judge at its last step."""
    w = FakeWorld(policy=policy)
    w.register("1", alias="champion")
    w.register("2", alias="candidate")
    for d in (None, None, "continue", "promote"):
        w.tick(d)
    return w


def test_a_passing_canary_waits_at_its_weight_instead_of_promoting() -> None:
    w = awaiting()
    assert w.phases == ["pending", "progressing", "progressing", "awaiting_approval"]
    assert w.routing.weight == 0.05 and w.registry.aliases["champion"] == "1"
    assert "rtrl approve 2 promotes it" in w.status.note
    for _ in range(5):
        w.tick("promote")
    assert w.status.phase == Phase.AWAITING_APPROVAL and w.routing.weight == 0.05
    run_ = w.ledger.runs[w.status.canary_id or ""]
    assert "judge: canary at least as good" in run_.tags["rtrl.approval.requested"]


def test_without_the_gate_the_judge_promotes_by_itself() -> None:
    w = awaiting(CanaryPolicy(steps=(0.01, 0.05), bake_s=60, max_duration_s=3600))
    assert w.phases[-2:] == ["promoting", "succeeded"]


def test_approve_promotes_as_the_operator() -> None:
    w = awaiting()
    w.tick("promote", commands=(cmd("approve", "2", reason="numbers look right"),))
    assert w.phases[-1] == "succeeded"
    assert w.status.handled[-1][1] == "approved: promoting v2"
    assert w.registry.aliases == {"champion": "2", "previous": "1"}
    tags = w.registry.tags["2"]
    assert tags[TAG_DECIDED_BY] == "alice" and tags[TAG_DECISION] == "promote"
    assert tags[TAG_REASON] == "approved by alice: numbers look right"


def test_rollback_rejects_the_waiting_canary() -> None:
    w = awaiting()
    w.tick("promote", commands=(cmd("rollback", by="bob"),))
    assert w.phases[-1] == "rolled_back" and w.routing.weight == 0.0
    assert w.registry.tags["2"][TAG_DECIDED_BY] == "bob" and "candidate" not in w.registry.aliases


def test_approve_needs_a_waiting_canary_of_that_version() -> None:
    w = awaiting()
    w.tick("promote", commands=(cmd("approve", "3"),))
    assert w.status.handled[-1][1] == "rejected: v2 awaits approval, not v3"
    assert w.status.phase == Phase.AWAITING_APPROVAL
    early = FakeWorld(policy=POLICY)
    early.register("1", alias="champion")
    early.register("2", alias="candidate")
    early.tick(), early.tick()
    early.tick("continue", commands=(cmd("approve", "2"),))
    assert early.status.handled[-1][1] == "rejected: no canary awaits approval (phase progressing)"
    assert early.status.phase == Phase.PROGRESSING


def test_no_decision_within_the_timeout_rolls_back() -> None:
    w = awaiting()
    w.tick("promote", dt=590)
    assert w.status.phase == Phase.AWAITING_APPROVAL
    w.tick("promote", dt=20)
    assert w.phases[-2:] == ["rolling_back", "rolled_back"]
    tags = w.registry.tags["2"]
    assert tags[TAG_REASON] == "approval timed out after 600s" and tags[TAG_DECIDED_BY] == "controller"
    assert "candidate" not in w.registry.aliases and w.registry.aliases["champion"] == "1"


def test_the_judge_still_rolls_back_a_waiting_canary() -> None:
    w = awaiting()
    w.tick("rollback")
    assert w.phases[-2:] == ["rolling_back", "rolled_back"]
    assert w.registry.tags["2"][TAG_REASON].startswith("judge: canary worse")


def test_a_restarted_controller_keeps_waiting_and_keeps_the_deadline() -> None:
    w = awaiting()
    w.tick("promote", dt=300)
    saved = json.dumps(w.status.to_json())
    fresh = FakeWorld(policy=POLICY, registry=w.registry, routing=w.routing, ledger=w.ledger,
                      status=CanaryStatus.from_json(json.loads(saved)), now=w.now)
    assert fresh.status == w.status and fresh.status.phase == Phase.AWAITING_APPROVAL
    fresh.tick("promote", dt=200)
    assert fresh.status.phase == Phase.AWAITING_APPROVAL and fresh.routing.weight == 0.05
    fresh.tick("promote", dt=200)  # 700 s after the wait began
    assert fresh.status.phase == Phase.ROLLED_BACK
    assert fresh.registry.tags["2"][TAG_REASON] == "approval timed out after 600s"


def test_approve_after_a_restart_promotes() -> None:
    w = awaiting()
    fresh = FakeWorld(policy=POLICY, registry=w.registry, routing=w.routing, ledger=w.ledger,
                      status=CanaryStatus.from_json(json.loads(json.dumps(w.status.to_json()))), now=w.now)
    fresh.tick(commands=(cmd("approve", "2", by="carol"),))
    assert fresh.status.phase == Phase.SUCCEEDED and fresh.registry.tags["2"][TAG_DECIDED_BY] == "carol"


def test_a_waiting_canary_whose_candidate_alias_moved_is_aborted() -> None:
    w = awaiting()
    w.register("3", alias="candidate")
    w.tick("promote")
    assert w.phases[-2:] == ["rolling_back", "aborted"]


def test_a_timed_out_approval_is_its_own_rollback_reason_in_the_metrics() -> None:
    w = awaiting()
    w.tick("promote", dt=700)
    assert reason_kind(w.status) == "approval"
