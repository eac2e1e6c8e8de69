"""Operator identity and the approval gate on real Redis, Kafka and MLflow: the deployer
refuses and records commands it cannot verify, executes signed ones as the operator who
signed them, and with the approval gate holds a passing canary until an operator approves."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from deployer_helpers import deployer_settings, feed_rewards, register_versions, with_operators

from deployer.adapters.ledger_mlflow import MlflowLedger
from deployer.adapters.mlflow_registry import MlflowRegistry
from deployer.ledger import TAG_DECIDED_BY, TAG_DECISION, TAG_OUTCOME, TAG_REASON
from deployer.operators import sign
from deployer.status import Command, Phase
from ingest.contracts import prometheus as m
from ingest.contracts.registry import TAG_CLAIMED_BY, TAG_KIND
from services.cli import operator
from services.settings.model import Settings
from services.wiring.deployer import build_controller, build_ports, reward_reader


@pytest.fixture
def ops(settings: Settings, mlflow_uri: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Settings, dict[str, Path]]]:
    s, tokens = with_operators(deployer_settings(settings, mlflow_uri, approval={"required": True}),
                               tmp_path, "alice")
    monkeypatch.setattr(operator, "get_settings", lambda: s)
    yield s, tokens


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = operator.main(list(argv))
    return code, capsys.readouterr().out


def counted(command: str, result: str) -> float:
    return m.OPERATOR_COMMANDS.labels(command, result)._value.get()


def ledger_of(s: Settings) -> MlflowLedger:
    return MlflowLedger(s.mlflow.tracking_uri, s.mlflow.deployments_experiment)


def test_unverified_promotes_are_refused_and_recorded_a_signed_one_runs_as_its_operator(
        ops: tuple[Settings, dict[str, Path]], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s, tokens = ops
    reg: MlflowRegistry = register_versions(s, tmp_path, n=2)
    reg.delete_alias("candidate")
    forged = tmp_path / "forged.token"
    forged.write_text("not-alices-token")
    before = {r: counted("promote", r) for r in ("unknown_operator", "bad_signature", "unsigned", "accepted")}

    code, out = cli(capsys, "promote", "2", "--by", "mallory", "--token-file", str(forged))
    assert code == 1 and out.strip() == "refused: unknown operator 'mallory'"
    code, out = cli(capsys, "promote", "2", "--by", "alice", "--token-file", str(forged))
    assert code == 1 and out.strip() == "refused: bad signature for operator 'alice'"
    code, out = cli(capsys, "promote", "2", "--by", "alice")  # no token at all
    assert code == 1 and out.strip().startswith("refused: unsigned command")
    assert reg.alias_version("champion") == "1"

    ledger = ledger_of(s)
    refused = [r for r in ledger.history() if r["kind"] == "refused_command"]
    assert len(refused) == 3 and {r["decision"] for r in refused} == {"refuse"}
    assert {r["decided_by"] for r in refused} == {"controller"}
    mallory = next(r for r in refused if "mallory" in r["reason"])
    tags = ledger.client.get_run(mallory["run_id"]).data.tags
    assert tags[TAG_KIND] == "refused_command" and tags[TAG_OUTCOME] == "refused"
    assert tags[TAG_CLAIMED_BY] == "mallory"
    assert tags[TAG_REASON] == "refused promote v2 claimed by mallory: unknown operator 'mallory'"
    for result in ("unknown_operator", "bad_signature", "unsigned"):
        assert counted("promote", result) == before[result] + 1, result

    code, out = cli(capsys, "promote", "2", "--by", "alice", "--token-file", str(tokens["alice"]),
                    "--reason", "hotfix")
    assert code == 0 and out.strip() == "promoting v2"
    assert reg.alias_version("champion") == "2"
    vtags = reg.get_tags("2")
    assert vtags[TAG_DECIDED_BY] == "alice" and vtags[TAG_DECISION] == "promote"
    promoted = next(r for r in ledger.history() if r["kind"] == "manual_promote")
    assert promoted["decided_by"] == "alice" and promoted["reason"] == "promoted by hand by alice: hotfix"
    assert counted("promote", "accepted") == before["accepted"] + 1
    code, out = cli(capsys, "history")
    assert "refused promote v2 claimed by mallory" in out and "promote-v2" in out


def test_a_copy_of_an_executed_command_is_refused_as_a_replay(
        ops: tuple[Settings, dict[str, Path]], tmp_path: Path) -> None:
    s, tokens = ops
    register_versions(s, tmp_path, n=2)
    token = tokens["alice"].read_text().strip()
    ports = build_ports(s)
    controller = build_controller(s, ports, None)
    pause = sign(Command(id=uuid.uuid4().hex, kind="pause", by="alice"), token, time.time())
    ports.state.push(pause)
    assert dict(controller.step().handled)[pause.id] == "paused"  # type: ignore[union-attr]
    # twenty newer commands push it out of the status's memory; the queue holds a copy again
    for _ in range(20):
        ports.state.push(sign(Command(id=uuid.uuid4().hex, kind="resume", by="alice"), token, time.time()))
    controller.step()
    ports.state.push(pause)
    status = controller.step()
    assert status is not None
    assert dict(status.handled)[pause.id] == f"refused: command {pause.id} was already executed"
    assert ports.state.pending() == ()


def test_approval_gate_holds_a_passing_canary_until_an_operator_approves(
        ops: tuple[Settings, dict[str, Path]], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s, tokens = ops
    register_versions(s, tmp_path)
    ports = build_ports(s)
    controller = build_controller(s, ports, reward_reader(s))
    try:
        assert controller.step().phase == Phase.PENDING  # type: ignore[union-attr]
        feed_rewards(s, "1", "2", "better", n=400)
        deadline = time.monotonic() + 120
        status = controller.step()
        while status is not None and status.phase == Phase.PROGRESSING and time.monotonic() < deadline:
            time.sleep(s.deployer.tick_s)
            status = controller.step()
        assert status is not None and status.phase == Phase.AWAITING_APPROVAL, status
        for _ in range(3):  # it waits: the judge alone does not promote
            time.sleep(s.deployer.tick_s)
            status = controller.step()
            assert status is not None and status.phase == Phase.AWAITING_APPROVAL
        assert ports.registry.alias_version("champion") == "1"
        code, out = cli(capsys, "status")
        assert "awaiting_approval" in out and "rtrl approve 2 promotes it" in out
    finally:
        ports.state.release()  # the CLI runs the tick itself
        controller.rewards.close()  # type: ignore[union-attr]
    code, out = cli(capsys, "approve", "2", "--by", "alice", "--token-file", str(tokens["alice"]),
                    "--reason", "reviewed the cohorts")
    assert code == 0 and out.strip() == "approved: promoting v2"
    assert ports.registry.alias_version("champion") == "2"
    tags = ports.registry.get_tags("2")
    assert tags[TAG_DECIDED_BY] == "alice" and tags[TAG_REASON] == "approved by alice: reviewed the cohorts"
    run_id = ledger_of(s).run_id(status.canary_id or "")
    assert run_id is not None
    run_tags = ledger_of(s).client.get_run(run_id).data.tags
    assert run_tags[TAG_DECIDED_BY] == "alice" and "rtrl.approval.requested" in run_tags
