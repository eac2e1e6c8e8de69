"""The canary controller on real Redis, Kafka and MLflow (sqlite store): a worse candidate
is rolled back by itself, a better one promoted, each with a complete ledger run and tags."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from deployer_helpers import deployer_settings, feed_rewards, register_versions

from deployer import records
from deployer.adapters.ledger_mlflow import PLOT_ARTIFACT, SUMMARY_ARTIFACT, MlflowLedger
from deployer.adapters.redis_state import RedisRouting
from deployer.controller import Controller
from deployer.ledger import TAG_DECIDED_BY, TAG_DECISION, TAG_OUTCOME, TAG_REASON
from deployer.status import CanaryStatus, Phase
from ingest.contracts.registry import TAG_CANARY_ID
from services.settings.model import Settings
from services.wiring.deployer import build_controller, build_ports, reward_reader


@pytest.fixture
def deploy(settings: Settings, mlflow_uri: str) -> Iterator[Settings]:
    yield deployer_settings(settings, mlflow_uri)


def run_until(controller: Controller, done: set[Phase], timeout_s: float = 120, tick_s: float = 0.2,
              ) -> list[str]:
    """Step ``controller`` every ``tick_s`` (deployer_settings' tick) until a phase of ``done``."""
    phases: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = controller.step()
        assert status is not None, "the controller lost its lease"
        if not phases or phases[-1] != status.phase.value:
            phases.append(status.phase.value)
        if status.phase in done:
            return phases
        time.sleep(tick_s)
    raise AssertionError(f"no {done} within {timeout_s}s; phases so far {phases}")


def start_canary(deploy: Settings, tmp_path: Path) -> tuple[Controller, CanaryStatus]:
    register_versions(deploy, tmp_path)
    ports = build_ports(deploy)
    controller = build_controller(deploy, ports, reward_reader(deploy))
    status = controller.step()
    assert status is not None and status.phase == Phase.PENDING
    assert RedisRouting(ports.state.r, deploy.redis.key_prefix).read() == {
        "canary_weight": "0.0", "salt": status.canary_id, "stable_version": "1", "canary_version": "2",
        "holdout": None}
    return controller, status


def assert_ledger(deploy: Settings, canary_id: str, decision: str, outcome: str) -> None:
    ledger = MlflowLedger(deploy.mlflow.tracking_uri, deploy.mlflow.deployments_experiment)
    run_id = ledger.run_id(canary_id)
    assert run_id is not None
    run = ledger.client.get_run(run_id)
    tags = run.data.tags
    assert tags["rtrl.canary.id"] == canary_id and run.info.status == "FINISHED"
    assert run.info.run_name == records.run_title(tags) == f"v2 {records.TITLE_WORDS[outcome]} by controller"
    assert tags[TAG_DECISION] == decision and tags[TAG_OUTCOME] == outcome
    assert tags[TAG_DECIDED_BY] == "controller" and tags[TAG_REASON]
    assert run.data.params["candidate_version"] == "2" and run.data.params["stable_version"] == "1"
    assert tags["rtrl.candidate.parent_version"] == "1"
    assert tags["rtrl.candidate.reward_spec_version"] == "test-1"
    metrics = run.data.metrics
    for key in ("canary.weight", "judge.verdict", "cohort.stable.reward_mean", "cohort.canary.reward_mean",
                "judge.reward.p_value", "judge.reward.estimate", "judge.users.canary",
                "judge.plan.users_per_min"):
        assert key in metrics, f"{key} missing from the ledger run"
    # the canary's plan: the canary users each primary metric needs, from the variance so far
    assert any(k.startswith("judge.plan.") and k.endswith(".needed") and v >= 1 for k, v in metrics.items())
    assert len(ledger.series(run_id, "judge.reward.p_value")) >= 1
    files = {a.path for a in ledger.client.list_artifacts(run_id)}
    assert {PLOT_ARTIFACT, SUMMARY_ARTIFACT} <= files
    png = Path(ledger.client.download_artifacts(run_id, PLOT_ARTIFACT))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5_000
    assert [r["canary_id"] for r in ledger.history()] == [canary_id]


def test_worse_candidate_is_rolled_back_automatically(deploy: Settings, tmp_path: Path) -> None:
    controller, status = start_canary(deploy, tmp_path)
    feed_rewards(deploy, "1", "2", "worse", n=100)
    phases = run_until(controller, {Phase.ROLLED_BACK, Phase.SUCCEEDED, Phase.ABORTED})
    assert phases[-1] == "rolled_back", phases
    assert "promoting" not in phases and "succeeded" not in phases
    reg = controller.ports.registry
    assert reg.alias_version("champion") == "1" and reg.alias_version("candidate") is None
    tags = reg.get_tags("2")
    assert tags[TAG_OUTCOME] == "rolled_back" and tags[TAG_DECISION] == "rollback"
    assert tags[TAG_DECIDED_BY] == "controller" and "worse" in tags[TAG_REASON]
    assert tags[TAG_CANARY_ID] == status.canary_id
    routing = RedisRouting(controller.ports.state.r, deploy.redis.key_prefix).read()
    assert routing["canary_weight"] == "0.0" and routing["canary_version"] is None
    assert routing["stable_version"] == "1"
    assert status.canary_id is not None
    assert_ledger(deploy, status.canary_id, "rollback", "rolled_back")


def test_better_candidate_is_promoted_automatically(deploy: Settings, tmp_path: Path) -> None:
    controller, status = start_canary(deploy, tmp_path)
    feed_rewards(deploy, "1", "2", "better", n=400)
    phases = run_until(controller, {Phase.ROLLED_BACK, Phase.SUCCEEDED, Phase.ABORTED})
    assert phases == ["progressing", "succeeded"], phases
    reg = controller.ports.registry
    assert reg.alias_version("champion") == "2" and reg.alias_version("previous") == "1"
    assert reg.alias_version("candidate") is None
    tags = reg.get_tags("2")
    assert tags[TAG_OUTCOME] == "promoted" and tags[TAG_DECISION] == "promote"
    assert tags[TAG_DECIDED_BY] == "controller"
    routing = RedisRouting(controller.ports.state.r, deploy.redis.key_prefix).read()
    assert routing["stable_version"] == "2" and routing["canary_version"] is None
    assert status.canary_id is not None
    assert_ledger(deploy, status.canary_id, "promote", "promoted")
    # the controller stepped through every weight before promoting
    ledger = MlflowLedger(deploy.mlflow.tracking_uri, deploy.mlflow.deployments_experiment)
    run_id = ledger.run_id(status.canary_id)
    assert run_id is not None
    assert {w for _, w in ledger.series(run_id, "canary.weight")} == {0.1, 0.5}


def test_second_controller_waits_for_the_lease(deploy: Settings, tmp_path: Path) -> None:
    controller, status = start_canary(deploy, tmp_path)
    other = build_controller(deploy, build_ports(deploy), None)
    assert other.step() is None
    assert controller.ports.state.load() == status
    controller.ports.state.release()
    assert other.step() is not None


def test_canary_failing_at_the_gateway_is_rolled_back_by_the_error_guardrail(
    deploy: Settings, tmp_path: Path
) -> None:
    """Failed requests make no reward record: the guardrail sees them only through the
    gateway's per-arm counts in Redis (deployer/adapters/served_counts.py)."""
    from deployer.adapters.served_counts import ServedCounts
    from services.runtime.redis_io import make_redis

    deploy = deployer_settings(deploy, deploy.mlflow.tracking_uri, judge_min_requests=50)
    controller, _status = start_canary(deploy, tmp_path)
    feed_rewards(deploy, "1", "2", "stable", n=100)  # rewards alone look identical
    counts = ServedCounts(make_redis(deploy.redis), deploy.redis.key_prefix)
    for i in range(300):
        counts.count("1", "stable", error=False)
        counts.count("2", "canary", error=i % 4 == 0)  # a quarter of canary requests fail
    counts.flush()
    phases = run_until(controller, {Phase.ROLLED_BACK, Phase.SUCCEEDED, Phase.ABORTED})
    assert phases[-1] == "rolled_back", phases
    reason = controller.ports.registry.get_tags("2")[TAG_REASON]
    assert "error" in reason.lower(), reason


@pytest.mark.parametrize(("quality", "n", "outcome", "late"), [
    ("better", 400, "promoted", "worse"), ("worse", 100, "rolled_back", "better")])
def test_replay_judges_a_recorded_canary_as_the_deployer_did(
    deploy: Settings, tmp_path: Path, quality: str, n: int, outcome: str, late: str
) -> None:
    """``rtrl replay``'s re-judging of a past canary (services/cli/replay.py) on the real ledger
    and rewards topic reproduces the deployer's verdict, although records of the canary's window
    arrived after the decision; judged on every record served in the window instead, the late
    records change the verdict (which is why the decision records what it was judged on)."""
    from datetime import UTC, datetime

    from deployer_helpers import feed_arms

    from ingest.reward.replay import Pair
    from services.cli.replay import canaries, ledger_rows, read_inputs
    from services.wiring.deployer import judge_policy_for

    controller, status = start_canary(deploy, tmp_path)
    feed_rewards(deploy, "1", "2", quality, n=n)
    run_until(controller, {Phase.ROLLED_BACK, Phase.SUCCEEDED, Phase.ABORTED})
    assert controller.ports.state.load().outcome == outcome
    served = datetime.fromtimestamp(status.started_at + 0.01, UTC)  # in the window, read too late
    feed_arms(deploy, [("stable", "1", "stable"), ("canary", "2", late)], n=1000, seed=7, served_at=served)

    [row] = ledger_rows(deploy)
    assert row["judged_on"] is not None, "the decision recorded no inputs"
    _events, live, _unreadable, where = read_inputs(deploy, None, None)
    assert len(live) == 2 * n + 2000
    pairs = [Pair(r, r) for r in live]
    policy = judge_policy_for(deploy)
    [again] = canaries(pairs, [row], policy, where)
    decision = {"promoted": "promote", "rolled_back": "rollback"}[outcome]
    assert again["exact"] and again["reproduces"], again
    assert again["recorded_verdict"] == again["live"]["verdict"] == decision
    assert again["live"]["users"] == [n, n]

    decided = datetime.fromtimestamp(row["judged_on"]["at"], UTC).isoformat()
    [naive] = canaries(pairs, [{**row, "judged_on": None, "decided_at": decided}], policy, where)
    assert not naive["exact"] and naive["live"]["users"] == [1000, 1000]  # the same user keys u-<arm>-<i>
    assert naive["live"]["verdict"] != decision, naive
