"""``rtrl train --now`` and ``rtrl bootstrap`` with a backend down: the backends they need are
checked first, each bounded, so a dead one is one line on stderr and exit code 4 within
seconds (not a traceback after minutes of client retries), and nothing is trained.

Dead backends are loopback ports nothing listens on; MLflow and Redis that answer are a
stub HTTP server and fakeredis's TCP server (real clients talk to them)."""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakeredis import TcpFakeServer

from services.cli import exit_codes

ROOT = Path(__file__).resolve().parents[2]
WALL_LIMIT_S = 10.0


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _AnyStatus(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def mlflow_answers() -> Iterator[int]:
    """A port where an HTTP server answers (404 to everything: the probe accepts any status)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _AnyStatus)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield int(server.server_address[1])
    server.shutdown()
    server.server_close()


@pytest.fixture
def redis_answers() -> Iterator[int]:
    port = _port()
    server = TcpFakeServer(("127.0.0.1", port), server_type="redis")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield port
    server.shutdown()
    server.server_close()


def _rtrl(args: list[str], tmp_path: Path, mlflow: int, redis: int,
          kafka: int) -> tuple[int, str, str, float]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RTRL_", "MLFLOW_HTTP_"))}
    env = {**base, "PYTHONPATH": str(ROOT), "MLFLOW_DISABLE_TELEMETRY": "true",
           "RTRL_STACK__DATA_DIR": str(tmp_path / "stack"),
           "RTRL_TRAINER__DATA_DIR": str(tmp_path / "trainer"),
           "RTRL_MLFLOW__TRACKING_URI": f"http://127.0.0.1:{mlflow}",
           "RTRL_REDIS__URL": f"redis://127.0.0.1:{redis}/0",
           "RTRL_KAFKA__BOOTSTRAP_SERVERS": f"127.0.0.1:{kafka}"}
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "services.cli", *args], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout, p.stderr, time.monotonic() - t0


def _one_line(code: int, out: str, err: str, wall: float) -> str:
    assert code == exit_codes.UNAVAILABLE, err
    assert wall < WALL_LIMIT_S and "Traceback" not in err and out == ""
    (line,) = err.strip().splitlines()
    return line


@pytest.mark.parametrize("args", [["train", "--now"], ["train", "--now", "--json"],
                                  ["bootstrap", "--records", "50", "--epochs", "1"]])
def test_mlflow_down_is_one_line_and_exit_4_before_any_training(args: list[str], tmp_path: Path) -> None:
    dead = _port()
    line = _one_line(*_rtrl(args, tmp_path, dead, dead, dead))
    assert line == (f"rtrl {args[0]}: MLflow at http://127.0.0.1:{dead} refused the connection "
                    "(set RTRL_MLFLOW__TRACKING_URI)")
    assert not (tmp_path / "trainer").exists()  # no corpus generated, no increment lock taken


def test_train_with_redis_down(tmp_path: Path, mlflow_answers: int) -> None:
    dead = _port()
    line = _one_line(*_rtrl(["train", "--now"], tmp_path, mlflow_answers, dead, dead))
    assert line == (f"rtrl train: Redis at redis://127.0.0.1:{dead}/0 refused the connection "
                    "(set RTRL_REDIS__URL)")


def test_train_with_kafka_down(tmp_path: Path, mlflow_answers: int, redis_answers: int) -> None:
    dead = _port()
    line = _one_line(*_rtrl(["train", "--now"], tmp_path, mlflow_answers, redis_answers, dead))
    assert line == (f"rtrl train: Kafka at 127.0.0.1:{dead} did not answer within 3s "
                    "(set RTRL_KAFKA__BOOTSTRAP_SERVERS)")
