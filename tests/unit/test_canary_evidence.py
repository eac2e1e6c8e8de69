"""Steps that advance on evidence and a budget in users (deployer/canary.py): a promote
verdict moves a step after ``min_bake_s`` instead of ``bake_s``; the canary's budget is
``budget_factor`` × the users its plan needs, and spent without a decision it aborts."""

from __future__ import annotations

from typing import Any

import pytest

from deployer.adapters.memory import FakeWorld
from deployer.canary import BUDGET_TAG
from deployer.status import CanaryPolicy, CanaryStatus, Phase

pytestmark = pytest.mark.unit

EVIDENCE = CanaryPolicy(steps=(0.05, 0.25, 0.5), bake_s=600, min_bake_s=60, max_duration_s=6 * 3600)


def world(policy: CanaryPolicy = EVIDENCE) -> FakeWorld:
    w = FakeWorld(policy=policy)
    w.register("1", alias="champion")
    w.register("2", gate="pass", alias="candidate")
    w.tick(None, dt=1)  # pending
    w.tick(None, dt=1)  # first step
    assert w.status.phase == Phase.PROGRESSING and w.status.step == 0
    return w


def plan(*metrics: tuple[str, int, int | None, bool]) -> dict[str, Any]:
    return {"metrics": [{"metric": name, "users": users, "needed": needed, "decided": decided}
                        for name, users, needed, decided in metrics]}


def test_a_promote_verdict_moves_each_step_after_the_least_bake_not_the_full_one() -> None:
    w = world()
    w.tick("promote", dt=30)
    assert w.status.step == 0, "a step is held for min_bake_s whatever the evidence"
    w.tick("promote", dt=30)
    assert w.status.step == 1 and w.routing.weight == 0.25
    w.tick("promote", dt=60)
    assert w.status.step == 2
    w.tick("promote", dt=59)
    assert w.status.phase == Phase.PROGRESSING, "promotion also waits min_bake_s on the last step"
    w.tick("promote", dt=1)
    assert w.status.phase == Phase.SUCCEEDED
    assert w.registry.aliases["champion"] == "2"
    assert w.now - w.status.started_at < 3 * 600 / 2, "the ramp took the evidence's time, not the bakes'"


def test_without_a_promote_verdict_a_step_waits_its_full_bake() -> None:
    w = world()
    for _ in range(9):
        w.tick("continue", dt=60)
    assert w.status.step == 0
    w.tick("continue", dt=60)
    assert w.status.step == 1
    for _ in range(10):
        w.tick("continue", dt=60)
    assert w.status.step == 2
    w.tick("continue", dt=600)
    assert w.status.phase == Phase.PROGRESSING, "no promotion without a promote verdict"


def test_a_verdict_that_turns_before_the_least_bake_keeps_the_step() -> None:
    w = world()
    w.tick("promote", dt=40)
    w.tick("continue", dt=40)  # past min_bake_s, but the evidence is gone
    assert w.status.step == 0


def test_a_paused_canary_holds_its_step_on_a_promote_verdict() -> None:
    w = world()
    w.status = CanaryStatus.from_json({**w.status.to_json(), "paused": True})
    w.tick("promote", dt=700)
    assert w.status.step == 0 and w.status.phase == Phase.PROGRESSING


def test_min_bake_above_bake_is_capped_at_bake() -> None:
    w = world(CanaryPolicy(steps=(0.1, 0.5), bake_s=30, min_bake_s=120, max_duration_s=3600))
    w.tick("continue", dt=30)
    assert w.status.step == 1


def test_the_budget_is_the_factor_times_the_largest_need_and_is_written_once() -> None:
    w = world()
    w.tick("continue", dt=10, plan=plan(("persistence", 50, 400, False), ("latency", 50, 100, False)))
    assert w.status.budget_users == 800
    w.tick("continue", dt=10, plan=plan(("persistence", 90, 300, False), ("latency", 90, 100, False)))
    assert w.status.budget_users == 800, "the budget never shrinks on a noisier estimate"
    w.tick("continue", dt=10, plan=plan(("persistence", 120, 500, False), ("latency", 120, 100, True)))
    assert w.status.budget_users == 1000
    (run_,) = w.ledger.runs.values()
    assert run_.tags[BUDGET_TAG] == "800", "the ledger has the budget the canary started with"


def test_an_undecided_canary_that_has_its_budgeted_users_is_aborted_as_inconclusive() -> None:
    w = world()
    w.tick("continue", dt=10, plan=plan(("persistence", 700, 400, False), ("latency", 900, 100, True)))
    assert w.status.phase == Phase.PROGRESSING, "one metric short of its budget: keep going"
    w.tick("continue", dt=10, plan=plan(("persistence", 800, 400, False), ("latency", 950, 100, True)))
    assert w.status.phase == Phase.ABORTED
    assert "budget of 800 canary users" in w.status.reason and "persistence 800 of 400" in w.status.reason
    assert w.registry.aliases == {"champion": "1"}


def test_no_budget_in_users_while_a_metric_has_no_need_yet_or_when_turned_off() -> None:
    w = world()
    w.tick("continue", dt=10, plan=plan(("persistence", 5000, None, False), ("latency", 5000, 10, False)))
    assert w.status.phase == Phase.PROGRESSING and w.status.budget_users == 0
    off = world(CanaryPolicy(steps=(0.05, 0.5), bake_s=600, min_bake_s=60, max_duration_s=3600,
                             budget_factor=None))
    off.tick("continue", dt=10, plan=plan(("persistence", 5000, 10, False)))
    assert off.status.phase == Phase.PROGRESSING and off.status.budget_users == 0


def test_the_wall_clock_cap_still_ends_a_canary_whose_users_never_come() -> None:
    w = world()
    w.tick("continue", dt=6 * 3600 + 1, plan=plan(("persistence", 10, 400, False)))
    assert w.status.phase == Phase.ABORTED and "21600s budget" in w.status.reason


@pytest.mark.parametrize("bad", [{"min_bake_s": -1}, {"budget_factor": 0.5}])
def test_policy_rejects_a_negative_least_bake_or_a_budget_below_the_plan(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        CanaryPolicy(**bad)  # type: ignore[arg-type]
