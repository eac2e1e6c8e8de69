"""Scale-out: 4 ingest and 4 reward workers share 8 partitions while a stream flows; 2 more
workers join mid-stream and 2 are SIGKILLed (and restarted: noida-db keeps a killed member),
so the groups rebalance several times under load. Afterwards ``rtrl reconcile``'s
accounting must show nothing lost and nothing duplicated.

Size: ``scale.current().scale_out_events`` raw records (CI 6,000; soak 40,000), on a broker
and Redis of this test's own."""

from __future__ import annotations

import os
import random
import re
import time
from collections import Counter
from pathlib import Path

import pytest

from services.runtime.kafka_io import ensure_topics
from services.settings.model import Settings
from tests.reliability import scale
from tests.reliability.workload import (
    CLIENTS,
    Progress,
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

PARTITIONS = 8
INITIAL = 4
"""Workers per kind at the start."""

pytestmark = pytest.mark.timeout(900 + scale.current().scale_out_events // 50)


@pytest.fixture
def settings(isolated_settings: Settings) -> Settings:
    s = isolated_settings
    return s.model_copy(update={"topics": s.topics.model_copy(update={"partitions": PARTITIONS})})


def held(worker: Worker) -> set[int]:
    """The input partitions a worker holds now, from its log's ``assigned``/``revoked`` lines."""
    now: set[int] = set()
    for line in worker.log.read_text(errors="replace").splitlines():
        for verb in ("assigned", "revoked"):
            if f"rtrl.{worker.kind}: {verb} " in line:
                parts = {int(x) for x in re.findall(r"\[(\d+)\]", line.split(f" {verb} ", 1)[1])}
                now = parts if verb == "assigned" else now - parts
    return now


def owners(workers: list[Worker]) -> dict[int, list[str]]:
    """Partition -> the live workers that hold it."""
    out: dict[int, list[str]] = {}
    for w in workers:
        if w.alive():
            for p in held(w):
                out.setdefault(p, []).append(w.instance)
    return out


def settled(by_partition: dict[int, list[str]]) -> bool:
    return sorted(by_partition) == list(range(PARTITIONS)) and all(len(o) == 1 for o in by_partition.values())


def settled_spread(workers: dict[str, list[Worker]], rewards: RewardCounter,
                   timeout_s: float = 60.0) -> dict[str, dict[int, list[str]]]:
    """Who holds which partition, once every partition has one owner (a rebalance may still
    be under way) or ``timeout_s`` has passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        spread = {kind: owners(ws) for kind, ws in workers.items()}
        if all(settled(v) for v in spread.values()) or time.monotonic() > deadline:
            return spread
        rewards.poll(200)


@pytest.mark.parametrize("client", CLIENTS)
def test_workers_joining_and_dying_mid_stream_lose_and_duplicate_nothing(settings: Settings, tmp_path: Path,
                                                                         client: str) -> None:
    sc = scale.current()
    rng = random.Random(20261127)
    wl = build(sc.scale_out_events, seed=11)
    stream_s = max(60.0, len(wl.records) / 150)
    rate = len(wl.records) / stream_s
    env = env_for(settings, tmp_path, RTRL_TOPICS__PARTITIONS=str(PARTITIONS), RTRL_KAFKA__CLIENT=client)
    ensure_topics(settings)

    def worker(kind: str, i: int) -> Worker:
        return Worker(kind, f"{kind}-{i}", env, tmp_path / f"{kind}-{i}.log", ["--max-batch", "200"])

    workers = {kind: [worker(kind, i) for i in range(INITIAL)] for kind in ("ingest", "reward")}
    everyone = [w for ws in workers.values() for w in ws]
    for w in everyone:
        w.start()
    prog = Progress(settings)
    rewards = RewardCounter(settings)
    events: list[str] = []
    try:
        wait_up(everyone)
        streamer = Streamer(settings, wl.records, rate)
        streamer.start()
        while not streamer.started_at:
            time.sleep(0.01)

        def at(share: float) -> None:
            while time.monotonic() - streamer.started_at < share * stream_s:
                rewards.poll(100)

        at(0.25)
        for kind in ("ingest", "reward"):  # two workers join
            w = worker(kind, INITIAL).start()
            workers[kind].append(w)
            everyone.append(w)
            events.append(f"{time.monotonic() - streamer.started_at:.1f}s {w.instance} joined")
        at(0.55)
        victims = [rng.choice(workers[kind][:INITIAL]) for kind in ("ingest", "reward")]
        for v in victims:  # two die mid-stream
            v.kill()
            events.append(f"{time.monotonic() - streamer.started_at:.1f}s {v.instance} SIGKILLed")
        time.sleep(rng.uniform(1.0, 3.0))
        for v in victims:
            v.start()
        at(0.8)
        spread = settled_spread(workers, rewards)
        streamer.join()
        assert streamer.error is None, streamer.error
        drain_s, codes = drain_and_stop(everyone, rewards, len(wl.requests), max(180.0, stream_s))
    finally:
        kill_alive(everyone)
        rewards.close()
        prog.close()
    assert all(c == 0 for c in codes.values()), f"SIGTERM must exit 0: {codes}"

    inp, rep = reconcile_topics(settings)
    figures = {
        "events": len(wl.records), "requests": len(wl.requests), "partitions": PARTITIONS,
        "workers": f"{INITIAL}+1 ingest, {INITIAL}+1 reward; 1 of each SIGKILLed and restarted",
        "stream_rate_eps": round(rate, 1), "drain_s_after_stream": round(drain_s, 1),
        "owners_at_80pct": {k: {p: len(o) for p, o in sorted(v.items())} for k, v in spread.items()},
        "loadavg_1m_end": round(os.getloadavg()[0], 1),
        **reconcile_figures(rep),
    }
    scale.record(scale.named("scale_out", client), {**figures, "client": client})
    print("\n".join(events))
    print(rep.render())

    assert rep.ok and rep.all_reflected, rep.render()
    assert rep.lost == 0 and rep.duplicated == 0
    assert rep.raw_records == len(wl.records)
    rewarded = Counter(r.request_id for r in inp.rewards)
    assert set(rewarded) == set(wl.requests) and max(rewarded.values()) == 1
    for kind, by_partition in spread.items():
        # after the rebalances every partition has exactly one live owner, and the work is spread
        assert settled(by_partition), (kind, by_partition)
        assert len({o[0] for o in by_partition.values()}) >= INITIAL, (kind, by_partition)
