"""The operator commands on a real Redis, Kafka and MLflow: ``--json`` documents, and
``rtrl status`` when only MLflow is down (Redis's view printed, one line, exit 4)."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from deployer_helpers import deployer_settings, register_versions, with_operators

from services.cli import exit_codes, main, operator
from services.settings.model import Settings


@pytest.fixture
def ops(settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Settings]:
    monkeypatch.chdir(tmp_path)  # the sqlite store puts artifacts under ./mlruns
    for var in ("MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_MAX_RETRIES"):  # restored after
        monkeypatch.setenv(var, os.environ.get(var, "3" if var.endswith("TIMEOUT") else "0"))
    s, tokens = with_operators(deployer_settings(settings, f"sqlite:///{tmp_path / 'mlflow.db'}"),
                               tmp_path, "dana")
    monkeypatch.setattr(operator, "get_settings", lambda: s)
    (tmp_path / "token-path").write_text(str(tokens["dana"]))
    yield s


def test_status_history_and_commands_print_one_json_document(
        ops: Settings, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    register_versions(ops, tmp_path)
    token = (tmp_path / "token-path").read_text()  # dana's token file, written by the fixture
    assert main(["pause", "--by", "dana", "--token-file", token, "--json"]) == exit_codes.OK
    done = json.loads(capsys.readouterr().out)
    assert done["command"] == "pause" and done["result"] == "paused" and done["exit_code"] == 0
    assert main(["status", "--json"]) == exit_codes.OK
    status = json.loads(capsys.readouterr().out)
    assert status["status"]["paused"] is True and status["aliases"]["champion"] in ("1", 1)
    assert status["registry_error"] is None
    assert main(["history", "--json"]) == exit_codes.OK
    assert isinstance(json.loads(capsys.readouterr().out), list)


def test_status_with_mlflow_down_prints_what_redis_knows_and_exits_4(
        ops: Settings, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    down = ops.model_copy(update={"mlflow": ops.mlflow.model_copy(
        update={"tracking_uri": f"http://127.0.0.1:{port}"})})
    monkeypatch.setattr(operator, "get_settings", lambda: down)
    assert main(["status"]) == exit_codes.UNAVAILABLE
    out, err = capsys.readouterr()
    assert out.startswith("champion") and "phase" in out
    assert err.strip() == (f"rtrl status: MLflow at http://127.0.0.1:{port} refused the connection "
                           "(set RTRL_MLFLOW__TRACKING_URI)")
