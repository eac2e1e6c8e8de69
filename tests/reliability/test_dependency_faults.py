"""Dependency faults: the broker, Redis or MLflow goes away under real services and comes back.

- **Broker restart** and **Redis restart**: a realistic event stream flows through real
  ``rtrl serve ingest`` and ``rtrl serve reward`` processes while the dependency is stopped
  cleanly (SIGTERM: noida-db and Redis (appendonly) save) and started again on the same
  port and data dir. The workers must stay up and reconnect by themselves; the time from
  the dependency answering again to the first new forwarded event / reward record is
  measured (Kafka timestamps of the records). Then ``rtrl reconcile``'s accounting must
  show nothing lost or duplicated and every event reflected in a reward or the DLQ.
- **MLflow unavailable** (trainer registration, deployer tick): tests/reliability/test_mlflow_outage.py.

The broker is stopped the way ``EmbeddedStack.stop_service`` does it: noida-db's own
``stop kafka`` first (it stops serving, then saves), then SIGTERM, waiting for the broker
process itself. A bare SIGTERM let noida-db acknowledge writes while it saved, and those
were missing after the restart.

Each test runs on a stack of its own (EmbeddedStack on free ports in a temporary folder),
never the session one. Sizes: ``scale.current().fault_events`` raw records per restart.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib

from services.runtime.kafka_io import ensure_topics, read_topic
from services.settings.model import Settings
from services.stack.embedded import EmbeddedStack
from tests.reliability import scale
from tests.reliability.workload import (
    RawOut,
    RewardCounter,
    Streamer,
    Worker,
    build,
    drain_and_stop,
    env_for,
    kill_alive,
    reconcile_figures,
    reconcile_topics,
    wait_up,
)

OUTAGE_S = 5.0
"""How long the broker or Redis stays down (the clean stop itself comes on top)."""
RECONNECT_LIMIT_S = 30.0
"""The bound a worker must reconnect within once its dependency answers again."""


@dataclass
class Private:
    stack: EmbeddedStack
    settings: Settings


@pytest.fixture
def private(isolated_stack: tuple[EmbeddedStack, Settings]) -> Private:
    """A broker and Redis of this test's own: the test stops and starts them."""
    return Private(*isolated_stack)


class AckedStreamer(Streamer):
    """Sends records to the raw topic at a fixed rate, as a careful client does: every send
    is checked, and one the producer reports failed (its batch was in flight when the broker
    stopped) is sent again until acknowledged. A resent record that had landed after all is
    dropped by ingest as a duplicate (or dead-lettered again, for invalid input)."""

    def __init__(self, settings: Settings, records: list[RawOut], rate: float) -> None:
        super().__init__(settings, records, rate)
        self.resent = 0
        self.pending: list[tuple[RawOut, Any]] = []

    def send(self, prod: Any, topic: str, r: RawOut) -> None:
        self.pending.append((r, prod.send(topic, value=r.value, key=r.key, headers=r.headers)))

    def finish(self, prod: Any, topic: str) -> None:
        deadline = time.monotonic() + 180
        pending = self.pending
        while pending:
            prod.flush(timeout=60)
            failed = [r for r, f in pending if f.failed()]
            assert time.monotonic() < deadline, f"{len(failed)} records never acknowledged"
            self.resent += len(failed)
            pending = [(r, prod.send(topic, value=r.value, key=r.key, headers=r.headers)) for r in failed]


def _first_after(records: list[Any], wall_ms: int) -> float | None:
    """Seconds from ``wall_ms`` to the first record stamped at or after it."""
    stamps = [r.timestamp for r in records if r.timestamp >= wall_ms]
    return (min(stamps) - wall_ms) / 1000 if stamps else None


def _restart_under_load(name: str, p: Private, tmp_path: Path) -> None:
    sc = scale.current()
    settings = p.settings
    t_start = time.monotonic()
    wl = build(sc.fault_events, seed=31 if name == "kafka" else 37, prefix=name[0])
    stream_s = max(30.0, len(wl.records) / 150)
    rate = len(wl.records) / stream_s
    env = env_for(settings, tmp_path)
    ensure_topics(settings)
    workers = [Worker(kind, f"{kind}-0", env, tmp_path / f"{kind}-0.log", ["--max-batch", "200"])
               for kind in ("ingest", "reward")]
    for w in workers:
        w.start()
    rewards = RewardCounter(settings)
    windows_checked = 0
    try:
        wait_up(workers)
        streamer = AckedStreamer(settings, wl.records, rate)
        streamer.start()
        while not streamer.started_at:
            time.sleep(0.01)
        while time.monotonic() - streamer.started_at < 0.35 * stream_s:
            rewards.poll(100)
        before: set[str] = set()
        r = redis_lib.Redis.from_url(settings.redis.url.get_secret_value())
        if name == "redis":  # the open join windows just before the stop
            pattern = f"{settings.redis.key_prefix}reward:w:*"
            before = {k.decode().rsplit(":", 1)[1] for k in r.scan_iter(pattern)}
        t_stop = time.monotonic()
        assert p.stack.stop_service(name), f"{name} was not running"
        stop_s = time.monotonic() - t_stop
        time.sleep(OUTAGE_S)
        p.stack.start_service(name, timeout_s=60)
        t_back = time.monotonic()
        back_wall_ms = int(time.time() * 1000)
        outage_s = t_back - t_stop
        if name == "redis":  # appendonly: every window open at the stop is still there or was closed
            pfx = settings.redis.key_prefix
            pipe = r.pipeline(transaction=False)
            for rid in sorted(before):
                pipe.exists(f"{pfx}reward:w:{rid}", f"{pfx}reward:done:{rid}")
            kept = pipe.execute()
            gone = [rid for rid, n in zip(sorted(before), kept, strict=True) if n == 0]
            assert not gone, f"{len(gone)} of {len(before)} join windows lost by the restart: {gone[:10]}"
            windows_checked = len(before)
        r.close()
        for w in workers:
            assert w.alive(), f"died while {name} was down:\n{w.obituary()}"
        streamer.join()
        assert streamer.error is None, streamer.error
        drain_s, codes = drain_and_stop(workers, rewards, len(wl.requests), max(60.0, stream_s))
    finally:
        kill_alive(workers)
        rewards.close()
    assert all(c == 0 for c in codes.values()), f"SIGTERM must exit 0: {codes}"

    inp, rep = reconcile_topics(settings)
    forwarded = read_topic(settings.kafka, settings.topics.events)
    reward_recs = read_topic(settings.kafka, settings.topics.rewards)
    reconnect_ingest = _first_after(forwarded, back_wall_ms)
    reconnect_reward = _first_after(reward_recs, back_wall_ms)
    logs = {w.kind: w.log.read_text(errors="replace") for w in workers}
    kinds_sent = wl.by_kind()
    figures = {
        "dependency": name,
        "events": len(wl.records),
        "requests": len(wl.requests),
        "stream_rate_eps": round(rate, 1),
        "workers": "1 ingest + 1 reward process",
        "stop_s": round(stop_s, 2),
        "outage_s": round(outage_s, 2),
        "reconnect_s_ingest": None if reconnect_ingest is None else round(reconnect_ingest, 2),
        "reconnect_s_reward": None if reconnect_reward is None else round(reconnect_reward, 2),
        **reconcile_figures(rep),
        "client_resends": streamer.resent,
        "join_windows_across_restart": windows_checked,
        "drain_s_after_stream": round(drain_s, 1),
        "wall_s": round(time.monotonic() - t_start, 1),
    }
    scale.record(f"{name}_restart", figures)
    print(rep.render())

    for kind, took in (("ingest", reconnect_ingest), ("reward", reconnect_reward)):
        assert took is not None and took < RECONNECT_LIMIT_S, (figures, logs[kind][-3000:])
    assert not rep.duplicate_forwarded and not rep.duplicate_rewards, rep.render()
    rewarded = Counter(r.request_id for r in inp.rewards)
    assert not rewarded or max(rewarded.values()) == 1
    assert rep.ok, rep.render()
    assert rep.all_reflected, rep.render()
    assert len(wl.records) <= rep.raw_records <= len(wl.records) + streamer.resent
    assert rep.raw_forwarded == kinds_sent["valid"]
    assert set(rewarded) == set(wl.requests)


def test_broker_restart_under_load_loses_and_duplicates_nothing(private: Private, tmp_path: Path) -> None:
    _restart_under_load("kafka", private, tmp_path)


def test_redis_restart_under_load_loses_and_duplicates_nothing(private: Private, tmp_path: Path) -> None:
    _restart_under_load("redis", private, tmp_path)
