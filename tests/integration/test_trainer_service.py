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

import pytest

from services.settings.model import Settings
from services.stack.embedded import free_port
from tests.ray_procs import ray_processes_of

NEXT_RUN = "select next_run_time from apscheduler_jobs where id='rtrl-increment'"


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:  # noqa: S310
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:  # not listening yet
        return 0, ""


def start(settings: Settings, tmp_path: Path, port: int, *extra: str,
          env_extra: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "RTRL_STACK__DATA_DIR": str(tmp_path / "no-stack"),
        "RTRL_KAFKA__BOOTSTRAP_SERVERS": settings.kafka.bootstrap_servers,
        "RTRL_TOPICS__REWARDS": settings.topics.rewards,
        "RTRL_MLFLOW__TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "RTRL_TRAINER__DATA_DIR": str(tmp_path / "trainer"),
        "RTRL_TRAINER__INTERVAL_S": "3600",
        **(env_extra or {}),
    }
    return subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "trainer",
                             "--port", str(port), *extra], env=env, cwd=Path(__file__).parents[2])


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


@pytest.mark.timeout(600)
@pytest.mark.parametrize("after_s", [0, 8], ids=["while-ray-starts-the-job", "while-training"])
def test_sigterm_during_an_increment_exits_0_and_leaves_the_window_pending(
    settings: Settings, tmp_path: Path, after_s: float
) -> None:
    """SIGTERM while an increment runs on local Ray: the trainer waits ``stop_grace_s``, then
    exits 0 with the window pending (the next run resumes it) and no Ray process left behind.

    Two failures this guards against, both seen on a busy machine: Ray's driver installs a C++
    failure-signal handler for SIGTERM that arms a 3 s abort (the trainer died of SIGABRT), and
    ``ray.shutdown()`` under the increment's thread made Ray end the process with exit code 1."""
    from deployer.adapters.mlflow_registry import MlflowRegistry
    from services.runtime.kafka_io import ensure_topics
    from services.settings.model import MlflowSettings, get_settings
    from services.settings.services import TrainerSettings
    from tests.integration.test_trainer_ray import bootstrap_champion, produce_rewards
    from trainer.window import PendingWindow

    ensure_topics(settings, [settings.topics.rewards])
    trainer = TrainerSettings(data_dir=tmp_path / "trainer", min_records=40, batch_size=4,
                              checkpoint_every=10_000, heldout_fraction=0.1, stop_grace_s=3)
    s = settings.model_copy(update={"trainer": trainer, "mlflow": MlflowSettings(
        tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")})
    champion = bootstrap_champion(s, tmp_path)
    registry = MlflowRegistry(s.mlflow.tracking_uri, s.mlflow.registered_model)
    produce_rewards(s, registry.download(champion, tmp_path / "champ"), 1500, start=0)
    get_settings.cache_clear()

    port = free_port()
    env_extra = {"RTRL_TRAINER": trainer.model_dump_json(), "RAY_AUTH_MODE": "disabled",
                 "RAY_USAGE_STATS_ENABLED": "0", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}
    proc = start(settings, tmp_path, port, "--run-on-start", env_extra=env_extra)
    pending = PendingWindow(trainer.data_dir / "pending_window.json")
    try:
        wait_for(lambda: pending.load() is not None and (trainer.data_dir / "ray").exists(), 240)
        time.sleep(after_s)  # 0: Ray is still setting up the job; 8: Ray Train is training
        assert proc.poll() is None, "the increment finished too early to test an interruption"
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        assert proc.wait(timeout=60) == 0
        assert time.monotonic() - t0 < 40
        wait_for(lambda: not ray_processes_of(proc.pid), 30)  # the local Ray node is gone too
    finally:
        if proc.poll() is None:
            proc.kill()
    assert pending.load() is not None, "the interrupted window stays pending for the next run"
    assert registry.versions() == [champion]


def _metrics(port: int) -> str:
    return get(f"http://127.0.0.1:{port}/metrics")[1]


def _cadence_env(settings: Settings, **extra: str) -> dict[str, str]:
    return {"RTRL_REDIS__URL": settings.redis.url.get_secret_value(),
            "RTRL_REDIS__KEY_PREFIX": settings.redis.key_prefix, "RTRL_TRAINER__CHECK_EVERY_S": "1", **extra}


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0


def test_a_due_increment_waits_for_the_canary_in_flight(settings: Settings, tmp_path: Path) -> None:
    """Real MLflow registry (sqlite), broker and Redis: the interval is due at start, but a
    candidate is under canary, so nothing trains until the canary is decided."""
    from deployer.adapters.mlflow_registry import MlflowRegistry
    from ingest.contracts.registry import CANDIDATE, Tag
    from services.runtime.redis_io import make_redis
    from trainer.adapters.redis_cadence import read_cadence

    registry = MlflowRegistry(f"sqlite:///{tmp_path / 'mlflow.db'}", settings.mlflow.registered_model,
                              settings.mlflow.training_experiment)
    (tmp_path / "policy").mkdir()
    (tmp_path / "policy" / "weights.bin").write_bytes(b"x")
    version = registry.register(None, tmp_path / "policy")
    registry.set_alias(CANDIDATE, version)  # no outcome yet: the canary is in flight
    port = free_port()
    proc = start(settings, tmp_path, port, "--run-on-start", env_extra=_cadence_env(settings))
    redis = make_redis(settings.redis)
    try:
        wait_for(lambda: 'rtrl_trainer_waiting{waiting_for="canary"} 1.0' in _metrics(port), 120)
        time.sleep(3)  # a few more checks: still waiting, nothing trained
        body = _metrics(port)
        assert 'rtrl_trainer_waiting{waiting_for="canary"} 1.0' in body
        assert "rtrl_trainer_increments_total{" not in body
        assert "rtrl_trainer_increment_starts_total{" not in body
        cadence = read_cadence(redis, settings.redis.key_prefix)
        assert cadence is not None and cadence["waiting_for"] == "canary" and cadence["canary"] == version
        assert cadence["due"] and f"canary v{version} in flight" in cadence["reason"]
        assert (tmp_path / "trainer" / "increment_due").exists()

        registry.set_tags(version, {Tag.CANARY_OUTCOME: "rolled_back"})  # the deployer decided
        wait_for(lambda: 'rtrl_trainer_increment_starts_total{trigger="interval"} 1.0' in _metrics(port), 60)
        # no champion, so the increment fails fast: what matters is that it started
        wait_for(lambda: 'rtrl_trainer_increments_total{outcome="failed"} 1.0' in _metrics(port), 60)
        assert not (tmp_path / "trainer" / "increment_due").exists()
        assert 'rtrl_trainer_waiting{waiting_for="canary"} 0.0' in _metrics(port)
        _stop(proc)
    finally:
        redis.close()
        if proc.poll() is None:
            proc.kill()


def test_enough_records_start_an_increment_before_the_interval(settings: Settings, tmp_path: Path) -> None:
    """Reward records on a real broker reach the trigger (count and users); the increment
    starts early and the next interval run moves to a full interval later."""
    from reward_helpers import reward_record

    from services.runtime.kafka_io import ensure_topics, make_producer

    ensure_topics(settings, [settings.topics.rewards])
    producer = make_producer(settings.kafka)

    def send(i: int, user: str) -> None:
        rec = reward_record(i, user)
        producer.send(settings.topics.rewards, key=rec.request_id.encode(),
                      value=rec.model_dump_json().encode())
    env = _cadence_env(settings, RTRL_TRAINER__TRIGGER__MIN_RECORDS="40", RTRL_TRAINER__TRIGGER__MIN_ESS="6",
                       RTRL_TRAINER__TRAIN_ON="all")
    port = free_port()
    proc = start(settings, tmp_path, port, env_extra=env)
    try:
        for i in range(40):  # 40 records from 2 users: enough records, too few users
            send(i, f"u{i % 2}")
        producer.flush()
        wait_for(lambda: "rtrl_trainer_pending_records 40.0" in _metrics(port), 120)
        body = _metrics(port)
        assert 'rtrl_trainer_waiting{waiting_for="records"} 1.0' in body
        assert "rtrl_trainer_pending_ess 2.0" in body
        assert "rtrl_trainer_increment_starts_total{" not in body
        for i in range(40, 80):  # 40 more from 20 new users: 80^2 / (2 * 20^2 + 20 * 2^2) = 7.3 users
            send(i, f"v{i % 20}")
        producer.flush()
        wait_for(lambda: 'rtrl_trainer_increment_starts_total{trigger="records"} 1.0' in _metrics(port), 60)
        wait_for(lambda: 'rtrl_trainer_increments_total{outcome="failed"} 1.0' in _metrics(port), 60)
        time.sleep(3)  # checks go on: a failed increment is not restarted at each one
        assert 'rtrl_trainer_increments_total{outcome="failed"} 1.0' in _metrics(port)
        _stop(proc)
    finally:
        producer.close()
        if proc.poll() is None:
            proc.kill()
    with sqlite3.connect(tmp_path / "trainer" / "jobs.sqlite") as conn:
        (next_run,) = conn.execute(NEXT_RUN).fetchone()
    assert next_run > time.time() + 3000, "the next interval run is a full interval after the early one"
