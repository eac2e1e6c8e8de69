"""The ``rtrl`` command in an incident: a backend that is down (nothing listens, or it accepts
and never answers) is one line on stderr and exit code 4 within seconds; ``--help`` never
acts; ``--version``; ``--json`` is one JSON document; each exit code of the table.

Backends here are loopback sockets made by the test: no broker, Redis or MLflow runs."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import fakeredis
import pytest

from services.cli import BENCH, COMMANDS, SERVE, exit_codes, main, operator
from services.settings.model import get_settings

ROOT = Path(__file__).resolve().parents[2]
WALL_LIMIT_S = 15.0


@pytest.fixture
def closed_port() -> int:
    """A loopback port nothing listens on (connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A loopback port that accepts connections and never answers (the kernel completes the
    handshakes into the backlog; nothing reads or writes)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(128)
        yield int(s.getsockname()[1])


def _rtrl(args: list[str], env: dict[str, str], cwd: Path) -> tuple[int, str, str, float]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RTRL_", "MLFLOW_HTTP_"))}
    full = {**base, "PYTHONPATH": str(ROOT), "MLFLOW_DISABLE_TELEMETRY": "true",
            "RTRL_STACK__DATA_DIR": str(cwd / "stack"), **env}
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "services.cli", *args], env=full, cwd=cwd,
                       capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout, p.stderr, time.monotonic() - t0


@pytest.mark.parametrize("args,backend,setting,port_kind", [
    (["history"], "MLflow", "RTRL_MLFLOW__TRACKING_URI", "closed"),
    (["history", "--json"], "MLflow", "RTRL_MLFLOW__TRACKING_URI", "silent"),
    (["status"], "Redis", "RTRL_REDIS__URL", "silent"),
    (["promote", "3", "--by", "test"], "Redis", "RTRL_REDIS__URL", "closed"),
    (["reconcile"], "Kafka", "RTRL_KAFKA__BOOTSTRAP_SERVERS", "silent"),
])
def test_a_backend_that_is_down_is_one_line_and_exit_4_within_seconds(
        args: list[str], backend: str, setting: str, port_kind: str, closed_port: int,
        silent_port: int, tmp_path: Path) -> None:
    port = closed_port if port_kind == "closed" else silent_port
    env = {"RTRL_MLFLOW__TRACKING_URI": f"http://127.0.0.1:{port}",
           "RTRL_REDIS__URL": f"redis://127.0.0.1:{port}/0",
           "RTRL_KAFKA__BOOTSTRAP_SERVERS": f"127.0.0.1:{port}"}
    code, out, err, wall = _rtrl(args, env, tmp_path)
    assert code == exit_codes.UNAVAILABLE, err
    assert wall < WALL_LIMIT_S
    assert "Traceback" not in err and out == ""
    (line,) = err.strip().splitlines()
    what = "refused the connection" if port_kind == "closed" else "did not answer within 3s"
    assert line.startswith(f"rtrl {args[0]}: {backend} at ") and f":{port}" in line
    assert line.endswith(f"{what} (set {setting})")


ALL_COMMANDS = ([[c] for c in COMMANDS] + [["serve", s] for s in SERVE] + [["bench", b] for b in BENCH]
                + [["events", "validate"], ["events", "schema"], ["stack", "status"]])


@pytest.mark.parametrize("argv", ALL_COMMANDS, ids=" ".join)
def test_help_of_every_command_exits_0_and_does_nothing(
        argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Every backend points at a closed port: a command that acted would fail or write."""
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    for key, value in {"RTRL_STACK__DATA_DIR": str(tmp_path / "stack"),
                       "RTRL_REDIS__URL": "redis://127.0.0.1:1/0",
                       "RTRL_KAFKA__BOOTSTRAP_SERVERS": "127.0.0.1:1",
                       "RTRL_MLFLOW__TRACKING_URI": "http://127.0.0.1:1"}.items():
        monkeypatch.setenv(key, value)
    get_settings.cache_clear()
    try:
        with pytest.raises(SystemExit) as exited:
            raise SystemExit(main([*argv, "--help"]))
    finally:
        get_settings.cache_clear()
    assert exited.value.code in (0, None)
    assert "usage: rtrl" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cwd"] and not any(work.iterdir())


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"rtrl {version('rtrl')}"
    assert main(["version", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["rtrl"] == version("rtrl") and doc["dependencies"]["mlflow"] == version("mlflow")
    assert doc["dependencies"]["kafka-python"] == version("kafka-python")


def test_exit_1_and_json_when_a_check_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    events = tmp_path / "events.jsonl"
    events.write_text('{"not": "an event"}\n')
    assert main(["events", "validate", str(events), "--json"]) == exit_codes.FAILED
    doc = json.loads(capsys.readouterr().out)
    assert doc["valid"] == 0 and doc["invalid"][0]["line"] == 1


def test_exit_2_on_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["no-such-command"]) == exit_codes.USAGE
    with pytest.raises(SystemExit) as exited:
        main(["history", "--no-such-flag"])
    assert exited.value.code == exit_codes.USAGE
    assert "Traceback" not in capsys.readouterr().err


def test_help_prints_the_exit_code_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert exit_codes.epilog() in capsys.readouterr().out


def test_exit_3_and_json_when_the_running_controller_does_not_answer(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A controller holds the lease but never handles the command: exit 3 after --timeout."""
    for var in ("MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_MAX_RETRIES"):  # restored after
        monkeypatch.setenv(var, os.environ.get(var, "0"))
    r = fakeredis.FakeRedis()
    prefix = get_settings().redis.key_prefix
    r.set(f"{prefix}deployer:lease", "deployer-elsewhere")
    monkeypatch.setattr(operator, "_redis", lambda settings: r)
    code = main(["pause", "--by", "test", "--timeout", "0.3", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == exit_codes.NOT_DONE and doc["exit_code"] == 3 and doc["command"] == "pause"
    assert "has not handled it within 0.3s" in doc["result"] and r.llen(f"{prefix}deployer:commands") == 1


def test_exit_130_on_ctrl_c(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def interrupted(argv: list[str]) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setitem(sys.modules, "rtrl_test_interrupted", types.SimpleNamespace(main=interrupted))
    monkeypatch.setitem(COMMANDS, "wait", ("rtrl_test_interrupted", "test"))
    assert main(["wait"]) == exit_codes.INTERRUPTED
    assert capsys.readouterr().err.strip() == "rtrl wait: interrupted"


def test_stack_status_json_starts_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("RTRL_STACK__DATA_DIR", str(tmp_path / "stack"))
    get_settings.cache_clear()
    try:
        assert main(["stack", "status", "--json"]) == 0
    finally:
        get_settings.cache_clear()
    doc = json.loads(capsys.readouterr().out)
    assert doc["services"]["kafka"]["state"] == "down" and not (tmp_path / "stack").exists()
