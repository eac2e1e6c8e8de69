"""A deployer killed with SIGKILL mid-canary: its successor resumes the same canary in the
same phase (never back to pending, never a lower step), finishes it with one complete
ledger run, and stops cleanly (exit 0) on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from deployer_helpers import deployer_settings, feed_rewards, register_versions

from deployer.adapters.ledger_mlflow import MlflowLedger
from deployer.ledger import TAG_DECIDED_BY, TAG_DECISION
from services.settings.model import Settings


def service_env(s: Settings, data_dir: Path) -> dict[str, str]:
    d = s.deployer
    env = {
        **os.environ,
        "RTRL_STACK__DATA_DIR": str(data_dir),
        "RTRL_KAFKA__BOOTSTRAP_SERVERS": s.kafka.bootstrap_servers,
        "RTRL_REDIS__URL": s.redis.url.get_secret_value(),
        "RTRL_REDIS__KEY_PREFIX": s.redis.key_prefix,
        "RTRL_TOPICS__REWARDS": s.topics.rewards,
        "RTRL_MLFLOW__TRACKING_URI": s.mlflow.tracking_uri,
        "RTRL_MLFLOW__REGISTERED_MODEL": s.mlflow.registered_model,
        "RTRL_MLFLOW__DEPLOYMENTS_EXPERIMENT": s.mlflow.deployments_experiment,
        "RTRL_HTTP__PORT": "0",
    }
    for name in ("tick_s", "bake_s", "lease_ttl_s", "judge_min_users", "poll_timeout_ms", "max_duration_s"):
        env[f"RTRL_DEPLOYER__{name.upper()}"] = str(getattr(d, name))
    env["RTRL_DEPLOYER__STEPS"] = json.dumps(list(d.steps))
    return env


def start(env: dict[str, str], cwd: Path, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli", "serve", "deployer"], env=env, cwd=cwd,
        stdout=log.open("ab"), stderr=subprocess.STDOUT,
    )


def wait_for(what: str, fn: Any, timeout_s: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.reliability  # also part of scripts/reliability (trainer, deployer and worker kills)
def test_killed_deployer_resumes_the_same_phase(settings: Settings, tmp_path: Path) -> None:
    cwd = Path.cwd()
    os.chdir(tmp_path)  # the sqlite store puts artifacts under ./mlruns
    try:
        _scenario(settings, tmp_path)
    finally:
        os.chdir(cwd)


def _scenario(settings: Settings, tmp_path: Path) -> None:
    s = deployer_settings(settings, f"sqlite:///{tmp_path / 'mlflow.db'}", steps=(0.1, 0.3, 0.5),
                          bake_s=3.0, tick_s=0.3, lease_ttl_s=1.5)
    register_versions(s, tmp_path)
    r = redis.Redis.from_url(s.redis.url.get_secret_value())
    prefix = s.redis.key_prefix

    def status() -> dict[str, Any] | None:
        raw = r.get(f"{prefix}deployer:status")
        return json.loads(raw) if raw else None

    env, log = service_env(s, tmp_path / "data"), tmp_path / "deployer.log"
    first = start(env, tmp_path, log)
    try:
        wait_for("a canary", lambda: (status() or {}).get("phase") in ("pending", "progressing"))
        feed_rewards(s, "1", "2", "better", n=400)
        before = wait_for("the second step", lambda: (st := status()) and st["step"] >= 1 and st)
        killed_owner = r.get(f"{prefix}deployer:lease")
        first.send_signal(signal.SIGKILL)
        first.wait(10)
    finally:
        if first.poll() is None:
            first.kill()
    at_kill = status()
    assert at_kill is not None and at_kill["phase"] == "progressing"
    assert at_kill["canary_id"] == before["canary_id"]

    second = start(env, tmp_path, log)
    try:
        lease = f"{prefix}deployer:lease"
        wait_for("the successor's lease", lambda: r.get(lease) not in (None, killed_owner))
        seen: list[dict[str, Any]] = []

        def finished() -> bool:
            st = status()
            assert st is not None
            if not seen or (st["phase"], st["step"]) != (seen[-1]["phase"], seen[-1]["step"]):
                seen.append(st)
            return bool(st["phase"] == "succeeded")

        wait_for("the promotion", finished)
        assert {st["canary_id"] for st in seen} == {at_kill["canary_id"]}
        phases = [st["phase"] for st in seen]
        assert phases[0] == "progressing" and "pending" not in phases and "idle" not in phases, phases
        steps = [st["step"] for st in seen if st["phase"] == "progressing"]
        assert steps[0] >= at_kill["step"] and steps == sorted(steps), steps
        second.send_signal(signal.SIGTERM)
        assert second.wait(30) == 0, log.read_text()[-3000:]
    finally:
        if second.poll() is None:
            second.kill()
    assert r.get(f"{prefix}deployer:lease") is None  # released on SIGTERM

    ledger = MlflowLedger(s.mlflow.tracking_uri, s.mlflow.deployments_experiment)
    (row,) = ledger.history()
    assert row["canary_id"] == at_kill["canary_id"] and row["decision"] == "promote"
    run = ledger.client.get_run(row["run_id"])
    assert run.data.tags[TAG_DECISION] == "promote" and run.data.tags[TAG_DECIDED_BY] == "controller"
    assert {w for _, w in ledger.series(row["run_id"], "canary.weight")} == {0.1, 0.3, 0.5}
