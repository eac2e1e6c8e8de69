"""Load soak: one ``rtrl serve ingest`` and one ``rtrl serve reward`` process sustain a fixed
event rate for ``scale.current().soak_seconds``; their memory stays flat and the consumer
lag stays bounded and returns to zero.

The rate is chosen in the same run, so it means the same thing on an idle machine and on a
busy 2-core one: a backlog of events is pushed through each worker in turn first (ingest,
then reward is started on everything ingest forwarded), each worker's throughput is
measured from its group's committed offsets, and the soak runs at
``SOAK_SHARE`` of the slower one.

The topics are created with a retention of ``RETENTION_S`` (as a production deployment
would have): the embedded broker keeps its log in memory, and without retention a soak at
thousands of events/s would need tens of GiB for the broker alone. The broker's RSS is
reported too.

Criteria (per worker, RSS sampled from /proc every second):
- memory flat: median RSS of the last third of the soak <= median of the first third
  x 1.10 + 16 MiB;
- lag bounded: records behind (ingest on the raw topic, reward on the events topic) never
  above ``LAG_BOUND_S`` seconds' worth of events at the soak rate;
- lag back near zero: within 60 s of the end of the stream, ingest 0 behind and reward at
  most one commit marker per partition behind, and every request rewarded.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import pytest
from kafka.admin import NewTopic

from services.runtime.kafka_io import ensure_topics, make_admin, topic_names
from services.settings.model import Settings
from services.stack.embedded import EmbeddedStack
from tests.reliability import scale
from tests.reliability.workload import (
    Progress,
    RewardCounter,
    Streamer,
    Worker,
    build,
    chunks,
    deaths,
    env_for,
    kill_alive,
    rss_of,
    wait_up,
)

SOAK_SHARE = 0.35
LAG_BOUND_S = 20.0
RETENTION_S = 120
"""Topic retention: far above ``LAG_BOUND_S``, so nothing a worker still has to read expires."""
MIB = 1024 * 1024

pytestmark = pytest.mark.timeout(int(scale.current().soak_seconds) + 900)


@pytest.fixture
def stack(isolated_stack: tuple[EmbeddedStack, Settings]) -> tuple[int, Settings]:
    """The broker's pid and settings on it; the topics, with retention, exist."""
    st, settings = isolated_stack
    admin = make_admin(settings.kafka)
    try:
        cfg = {"retention.ms": str(RETENTION_S * 1000), "segment.ms": str(RETENTION_S * 1000 // 4)}
        admin.create_topics([NewTopic(n, settings.topics.partitions, 1, topic_configs=cfg)
                             for n in topic_names(settings.topics)])
    finally:
        admin.close()
    assert not ensure_topics(settings), "the topics were not created with retention"
    return int(st.state["kafka"]["pid"]), settings


def _throughput(prog: Progress, kind: str, worker: Worker, target: int, timeout_s: float,
                events_per_offset: float = 1.0) -> float:
    """Events/s of a worker on a backlog, from its group's committed offsets (first commit to
    the first at or past ``target``), so process start-up and group join are excluded."""
    group, topic = prog.input_of(kind)
    first: tuple[float, int] | None = None
    deadline = time.monotonic() + timeout_s
    while True:
        n = prog.committed(group, topic)
        now = time.monotonic()
        if n > 0 and first is None:
            first = (now, n)
        if first is not None and n >= target:
            assert n > first[1], f"{kind}: the whole backlog was committed at once; use a larger one"
            return (n - first[1]) * events_per_offset / (now - first[0])
        assert now < deadline, f"{kind}: {n} of {target} offsets committed in {timeout_s} s"
        assert worker.alive(), f"{kind} exited; see {worker.log}"
        time.sleep(0.05)


def test_memory_flat_and_lag_bounded_at_a_sustained_rate(stack: tuple[int, Settings], tmp_path: Path) -> None:
    broker_pid, settings = stack
    sc = scale.current()
    t_start = time.monotonic()
    load_start = os.getloadavg()[0]  # other jobs on the machine: context for every figure
    env = env_for(settings, tmp_path)
    ingest = Worker("ingest", "ingest-0", env, tmp_path / "ingest.log")
    reward = Worker("reward", "reward-0", env, tmp_path / "reward.log")
    workers = [ingest, reward]
    prog = Progress(settings)
    rewards = RewardCounter(settings)
    try:
        # 1. what the pipeline sustains here and now: a backlog through each worker in turn
        # (one at a time, so neither has drained its input before its measurement starts)
        _start(ingest, tmp_path)
        backlog = build(20_000, seed=1, prefix="cap")
        valid = sum(r.kind == "valid" for r in backlog.records)
        feeder = Streamer(settings, backlog.records, float("inf"))
        feeder.start()
        ingest_eps = _throughput(prog, "ingest", ingest, len(backlog.records), 300)
        feeder.join()
        # the reward group reads only forwarded (valid) events; their offsets also count one
        # commit marker per ingest transaction and partition, so the target is the end offset
        # less the last marker of each partition, and offsets are scaled to events
        _start(reward, tmp_path)
        end = prog.end(prog.input_of("reward")[1])
        assert end >= valid
        reward_eps = _throughput(prog, "reward", reward, end - settings.topics.partitions, 300,
                                 events_per_offset=valid / end)
        capacity = min(ingest_eps, reward_eps)
        rate = SOAK_SHARE * capacity
        deadline = time.monotonic() + 120
        while rewards.poll(200) < len(backlog.requests):
            assert time.monotonic() < deadline, "the backlog's rewards did not all arrive"

        # 2. the soak at that rate
        requests: list[str] = []
        n_soak = int(rate * sc.soak_seconds)
        streamer = Streamer(settings, chunks(n_soak, seed=100, requests=requests), rate)
        samples: list[dict[str, float]] = []
        streamer.start()
        while not streamer.started_at:
            time.sleep(0.01)
        next_sample = streamer.started_at
        while streamer.is_alive():
            rewards.poll(100)
            now = time.monotonic()
            if now >= next_sample:
                next_sample += 1.0
                lag_i, lag_r = prog.lags()
                samples.append({
                    "t": now - streamer.started_at, "ingest_rss": float(ingest.rss_bytes() or 0),
                    "reward_rss": float(reward.rss_bytes() or 0),
                    "broker_rss": float(rss_of(broker_pid) or 0), "ingest_lag": lag_i, "reward_lag": lag_r,
                    "sent": streamer.sent,
                })
                assert all(w.alive() for w in workers), f"died during the soak:\n{deaths(workers)}"
        assert streamer.error is None, streamer.error
        stream_s = streamer.finished_at - streamer.started_at
        # 3. back near zero after the stream
        t_end = time.monotonic()
        expected = len(backlog.requests) + len(requests)
        drained_s: float | None = None
        while time.monotonic() - t_end < 60:
            n = rewards.poll(200)
            lag_i, lag_r = prog.lags()
            if lag_i == 0 and lag_r <= settings.topics.partitions and n >= expected:
                drained_s = time.monotonic() - t_end
                break
        end_lags = prog.lags()
        codes = [w.stop() for w in workers]
    finally:
        kill_alive(workers)
        rewards.close()
        prog.close()

    third = max(1, len(samples) // 3)
    figures: dict[str, object] = {
        "capacity_ingest_eps": round(ingest_eps, 1),
        "capacity_reward_eps": round(reward_eps, 1),
        "capacity_backlog_events": len(backlog.records),
        "soak_rate_eps": round(rate, 1),
        "soak_rate_share_of_capacity": round(rate / capacity, 3),
        "soak_events": n_soak,
        "soak_requests": len(requests),
        "soak_s": round(stream_s, 1),
        "achieved_rate_eps": round(n_soak / stream_s, 1),
        "samples": len(samples),
        "lag_bound_records": round(LAG_BOUND_S * rate),
        "drained_s_after_stream": None if drained_s is None else round(drained_s, 1),
        "end_lag_ingest": end_lags[0],
        "end_lag_reward": end_lags[1],
        "rewards": len(rewards.counts),
        "rewards_expected": expected,
        "loadavg_1m_start_end": [round(load_start, 1), round(os.getloadavg()[0], 1)],
        "wall_s": round(time.monotonic() - t_start, 1),
    }
    flat: dict[str, bool] = {}
    for kind in ("ingest", "reward"):
        rss = [s[f"{kind}_rss"] for s in samples]
        lag = [s[f"{kind}_lag"] for s in samples]
        first, last = statistics.median(rss[:third]), statistics.median(rss[-third:])
        flat[kind] = last <= first * 1.10 + 16 * MIB
        figures.update({
            f"{kind}_rss_mib_first_third_median": round(first / MIB, 1),
            f"{kind}_rss_mib_last_third_median": round(last / MIB, 1),
            f"{kind}_rss_mib_max": round(max(rss) / MIB, 1),
            f"{kind}_rss_growth_mib": round((last - first) / MIB, 1),
            f"{kind}_lag_max_records": max(lag),
            f"{kind}_lag_max_s": round(max(lag) / rate, 2),
            f"{kind}_lag_median_records": statistics.median(lag),
            f"{kind}_memory_flat": flat[kind],
        })
    broker = [s["broker_rss"] for s in samples]
    figures.update({  # reported, not judged: retention frees whole segments, in steps
        "topic_retention_s": RETENTION_S,
        "broker_rss_mib_first_third_median": round(statistics.median(broker[:third]) / MIB, 1),
        "broker_rss_mib_last_third_median": round(statistics.median(broker[-third:]) / MIB, 1),
        "broker_rss_mib_max": round(max(broker) / MIB, 1),
    })
    step = max(1, len(samples) // 120)
    picked = samples[::step]
    series: dict[str, list[float]] = {"t_s": [round(x["t"], 1) for x in picked]}
    for k in ("ingest", "reward"):  # every step-th sample: RSS MiB and records behind
        series[f"{k}_rss_mib"] = [round(x[f"{k}_rss"] / MIB, 1) for x in picked]
        series[f"{k}_lag"] = [int(x[f"{k}_lag"]) for x in picked]
    series["broker_rss_mib"] = [round(x["broker_rss"] / MIB, 1) for x in picked]
    figures["series"] = series
    scale.record("load_soak", figures)

    assert codes == [0, 0], f"SIGTERM must exit 0: {codes}"
    assert n_soak / stream_s >= 0.9 * rate, "the test's own producer could not hold the rate"
    for kind in ("ingest", "reward"):
        assert flat[kind], f"{kind} memory grew: {figures}"
        assert figures[f"{kind}_lag_max_s"] <= LAG_BOUND_S, f"{kind} fell behind: {figures}"  # type: ignore[operator]
    assert drained_s is not None, f"lag did not return near zero within 60 s: {figures}"
    assert max(rewards.counts.values()) == 1


def _start(worker: Worker, tmp_path: Path) -> None:
    worker.start()
    wait_up([worker])
