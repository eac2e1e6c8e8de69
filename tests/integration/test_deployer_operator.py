"""The operator CLI on real Redis, Kafka and MLflow: manual promote, rollback of the champion,
pause/resume of a running canary; each signed with the operator's token and recorded in the
ledger with decided_by = the verified operator."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from deployer_helpers import deployer_settings, register_versions, with_operators

from deployer.adapters.ledger_mlflow import MlflowLedger
from deployer.adapters.mlflow_registry import MlflowRegistry
from deployer.ledger import TAG_DECIDED_BY, TAG_DECISION, TAG_OUTCOME
from services.cli import operator
from services.settings.model import Settings


@pytest.fixture
def ops(settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Settings]:
    cwd = Path.cwd()
    os.chdir(tmp_path)  # the sqlite store puts artifacts under ./mlruns
    s, tokens = with_operators(deployer_settings(settings, f"sqlite:///{tmp_path / 'mlflow.db'}"), tmp_path,
                               "alice", "bob", "carol")
    TOKENS.clear()
    TOKENS.update(tokens)
    monkeypatch.setattr(operator, "get_settings", lambda: s)
    try:
        yield s
    finally:
        os.chdir(cwd)


TOKENS: dict[str, Path] = {}


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """Run the CLI; a command given ``--by NAME`` is signed with that operator's token."""
    args = list(argv)
    if "--by" in args:
        args += ["--token-file", str(TOKENS[args[args.index("--by") + 1]])]
    code = operator.main(args)
    return code, capsys.readouterr().out


def test_manual_promote_then_rollback_of_the_champion(ops: Settings, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    reg: MlflowRegistry = register_versions(ops, tmp_path, n=3)
    reg.delete_alias("candidate")
    reg.set_tags("3", {"rtrl.gate.result": "fail"})
    code, out = cli(capsys, "promote", "3", "--by", "alice")
    assert code == 1 and "gate result fail" in out
    code, out = cli(capsys, "promote", "2", "--by", "alice", "--reason", "hotfix")
    assert code == 0 and out.strip() == "promoting v2"
    assert reg.alias_version("champion") == "2" and reg.alias_version("previous") == "1"
    tags = reg.get_tags("2")
    assert tags[TAG_DECIDED_BY] == "alice" and tags[TAG_DECISION] == "promote"

    code, out = cli(capsys, "rollback", "--by", "bob", "--reason", "users complain")
    assert code == 0 and "rolling back the champion v2 to v1" in out
    assert reg.alias_version("champion") == "1" and reg.alias_version("previous") == "2"
    assert reg.get_tags("2")[TAG_OUTCOME] == "rolled_back" and reg.get_tags("2")[TAG_DECIDED_BY] == "bob"

    code, out = cli(capsys, "history")
    lines = out.splitlines()
    assert code == 0 and len(lines) == 3
    assert "restore-v1" in lines[1] and "rollback" in lines[1] and "bob" in lines[1]
    assert "promote-v2" in lines[2] and "alice" in lines[2] and "hotfix" in lines[2]
    ledger = MlflowLedger(ops.mlflow.tracking_uri, ops.mlflow.deployments_experiment)
    assert {r["decided_by"] for r in ledger.history()} == {"alice", "bob"}

    code, out = cli(capsys, "status")
    assert code == 0 and "v1 (gate pass)" in out and "rolled_back by bob" in out


def test_pause_resume_and_rollback_of_a_new_canary(ops: Settings, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    register_versions(ops, tmp_path)
    code, out = cli(capsys, "pause", "--by", "carol")
    assert code == 0 and out.strip() == "paused"
    code, out = cli(capsys, "status")
    assert "[PAUSED]" in out and "candidate v2 waits" in out
    code, out = cli(capsys, "resume", "--by", "carol")
    assert code == 0 and out.strip() == "resumed"
    code, out = cli(capsys, "status")
    assert "pending" in out and "[PAUSED]" not in out
    code, out = cli(capsys, "rollback", "--to", "1", "--by", "carol")
    assert code == 1 and out.startswith("rejected: the canary of v2 is in progress")
    code, out = cli(capsys, "rollback", "--by", "carol")
    assert code == 0 and out.strip() == "rolling back v2"
    reg = MlflowRegistry(ops.mlflow.tracking_uri, ops.mlflow.registered_model)
    assert reg.alias_version("candidate") is None
