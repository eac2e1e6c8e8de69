"""`rtrl serve trainer` as a process: persistent schedule, run on start, metrics and health,
SIGTERM -> exit 0, and a restart that keeps the stored schedule. No champion exists, so the
increment fails fast with its reason (no Ray needed here; tests/integration/test_trainer_ray.py
covers the increment itself)."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from services.settings import Settings
from services.stack import free_port

NEXT_RUN = "select next_run_time from apscheduler_jobs where id='rtrl-increment'"


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:  # noqa: S310
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:  # not listening yet
        return 0, ""


def start(settings: Settings, tmp_path: Path, port: int, *extra: str) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "RTRL_STACK__DATA_DIR": str(tmp_path / "no-stack"),
        "RTRL_KAFKA__BOOTSTRAP_SERVERS": settings.kafka.bootstrap_servers,
        "RTRL_TOPICS__REWARDS": settings.topics.rewards,
        "RTRL_MLFLOW__TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "RTRL_TRAINER__DATA_DIR": str(tmp_path / "trainer"),
        "RTRL_TRAINER__INTERVAL_S": "3600",
    }
    return subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "trainer",
                             "--metrics-port", str(port), *extra], env=env, cwd=Path(__file__).parents[2])


def wait_for(pred: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():  # type: ignore[operator]
            return
        time.sleep(0.5)
    raise AssertionError("condition not met in time")


def test_serve_trainer_schedules_persistently_and_stops_cleanly(settings: Settings, tmp_path: Path) -> None:
    port = free_port()
    proc = start(settings, tmp_path, port, "--run-on-start")
    try:
        wait_for(lambda: "rtrl_trainer_increments_total{outcome=\"failed\"} 1.0"
                 in get(f"http://127.0.0.1:{port}/metrics")[1], 120)
        body = get(f"http://127.0.0.1:{port}/metrics")[1]
        assert "rtrl_trainer_cadence_seconds 3600.0" in body
        assert get(f"http://127.0.0.1:{port}/healthz")[0] == 200
        status, ready = get(f"http://127.0.0.1:{port}/readyz")
        assert status == 200 and json.loads(ready)["ok"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    db = tmp_path / "trainer" / "jobs.sqlite"
    with sqlite3.connect(db) as conn:
        (next_run,) = conn.execute(NEXT_RUN).fetchone()
    assert next_run > time.time() + 3000  # next run about an hour after the start-up run

    port2 = free_port()
    proc = start(settings, tmp_path, port2)
    try:
        wait_for(lambda: get(f"http://127.0.0.1:{port2}/healthz")[0] == 200, 60)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    with sqlite3.connect(db) as conn:
        (kept,) = conn.execute(NEXT_RUN).fetchone()
    assert kept == next_run  # the restart kept the stored schedule
