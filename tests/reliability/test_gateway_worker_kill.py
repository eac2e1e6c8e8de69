"""A gateway worker SIGKILLed under traffic, with the pipeline behind it: real ``rtrl serve
gateway`` (two workers) in front of a stand-in engine, ``rtrl serve ingest`` and ``rtrl
serve reward``. Afterwards ``rtrl reconcile --strict`` must find nothing lost or duplicated
and every served request rewarded once, and every request a client saw answered must be
among them: the killed worker's spooled events were shipped, and the shipper's redeliveries
were dropped by ingest as duplicates."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from bench.fake_engine import FakeEngine
from services.runtime.kafka_io import ensure_topics
from services.settings.model import Settings
from tests.gateway_proc import Gateway, Load, served_events
from tests.reliability.workload import (
    KEY_ID,
    RTRL,
    SECRET,
    RewardCounter,
    Worker,
    drain_and_stop,
    env_for,
    kill_alive,
    wait_up,
)

pytestmark = pytest.mark.timeout(600)

TIME_SCALE = "0.005"
"""Served requests get no client events here, so each closes at its due time: (3600 + 30) s
scaled to about 18 s."""


def test_a_killed_gateway_worker_loses_no_reward(isolated_settings: Settings, tmp_path: Path) -> None:
    settings = isolated_settings
    ensure_topics(settings)
    env = env_for(settings, tmp_path, RTRL_REWARD__TIME_SCALE=TIME_SCALE)
    workers = [Worker(kind, f"{kind}-0", env, tmp_path / f"{kind}.log").start()
               for kind in ("ingest", "reward")]
    engine = FakeEngine(token_ms=2.0).start()
    gw = Gateway(settings, tmp_path, engine.base_url, workers=2,
                 RTRL_GATEWAY__KEY_ID=KEY_ID, RTRL_GATEWAY__SECRET=SECRET)
    rewards = RewardCounter(settings)
    try:
        wait_up(workers)
        gw.wait_ready(2)
        with Load(gw.port, clients=8) as load:
            time.sleep(2.0)
            victim = random.Random(11).choice(sorted(gw.worker_pids()))
            os.kill(victim, signal.SIGKILL)
            time.sleep(4.0)
        assert gw.stop() == 0, gw.output()
        served = {e.request_id for e in served_events(settings, len(load.answered))}
        drain_s, codes = drain_and_stop(workers, rewards, len(served), 180.0)
    finally:
        gw.stop()
        kill_alive(workers)
        rewards.close()
        engine.stop()
    assert all(c == 0 for c in codes.values()), codes
    assert load.answered and load.answered <= served, sorted(load.answered - served)[:10]
    assert set(rewards.counts) == served and max(rewards.counts.values()) == 1
    cli = subprocess.run([RTRL, "reconcile", "--strict", "--json"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stdout[-3000:] + cli.stderr[-3000:]
    doc = json.loads(cli.stdout)
    assert (doc["ok"], doc["all_reflected"], doc["reward_records"]) == (True, True, len(served))
    print(f"answered {len(load.answered)} of {load.sent}; served {len(served)}; rewards drained in "
          f"{drain_s:.1f} s; raw duplicates dropped by ingest: {doc.get('raw_duplicates_dropped')}")
