"""Idle workers cost (almost) nothing: real ``rtrl serve ingest`` and ``rtrl serve reward``
processes, with their default poll settings, first take a short stream, then sit at lag 0
while their CPU time is read from /proc. Each must stay at or under 2% of one core.

Size: ``scale.current().idle_seconds`` of measurement (CI 30 s, soak 5 minutes)."""

from __future__ import annotations

import os
import time
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
    env_for,
    kill_alive,
    wait_up,
)

MAX_IDLE_SHARE = 0.02
"""The most of one core an idle worker may use."""

pytestmark = pytest.mark.timeout(240 + int(scale.current().idle_seconds))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc/<pid>/stat (fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_cpu_share_reads_what_the_process_burns() -> None:
    # Burn half a second of this process's own CPU (not of the wall clock, which a busy
    # machine stretches), then /proc must show it: the reading can fail.
    pid = os.getpid()
    t0, c0, w0 = cpu_seconds(pid), time.process_time(), time.monotonic()
    while time.process_time() - c0 < 0.5 and time.monotonic() - w0 < 30:
        pass
    burnt = time.process_time() - c0
    assert burnt >= 0.5
    assert cpu_seconds(pid) - t0 == pytest.approx(burnt, abs=0.05)


@pytest.mark.parametrize("client", CLIENTS)
def test_idle_workers_use_at_most_two_percent_of_a_core(settings: Settings, tmp_path: Path,
                                                        client: str) -> None:
    sc = scale.current()
    env = env_for(settings, tmp_path, RTRL_KAFKA__CLIENT=client)
    for name in ("RTRL_INGEST__POLL_TIMEOUT_MS", "RTRL_REWARD__POLL_TIMEOUT_MS", "RTRL_REWARD__IDLE_POLL_MS"):
        env.pop(name, None)  # the defaults a deployment gets
    ensure_topics(settings)
    workers = [Worker(kind, f"{kind}-idle", env, tmp_path / f"{kind}.log") for kind in ("ingest", "reward")]
    prog = Progress(settings)
    rewards = RewardCounter(settings)
    try:
        for w in workers:
            w.start()
        wait_up(workers)
        wl = build(300, seed=31)
        streamer = Streamer(settings, wl.records, rate=300)
        streamer.start()
        streamer.join(60)
        assert streamer.error is None, streamer.error
        deadline = time.monotonic() + 120
        while (rewards.poll(200) < len(wl.requests) or max(prog.lags()) > 4) and time.monotonic() < deadline:
            pass
        assert rewards.poll(200) == len(wl.requests), "the stream was not rewarded before the idle check"
        start = {w.kind: cpu_seconds(w.pid) for w in workers}
        w0 = time.monotonic()
        time.sleep(sc.idle_seconds)
        wall = time.monotonic() - w0
        share = {w.kind: (cpu_seconds(w.pid) - start[w.kind]) / wall for w in workers}
        lags = prog.lags()
        figures = {"client": client, "seconds": round(wall, 1), "lags_after": list(lags),
                   **{f"{k}_core_share": round(v, 4) for k, v in share.items()}}
        scale.record(scale.named("idle_cost", client), figures)
        assert all(w.alive() for w in workers)
        assert max(lags) <= 4, f"the workers were not idle: lags {lags}"
        for kind, used in share.items():
            assert used <= MAX_IDLE_SHARE, f"idle {kind} worker used {used:.1%} of a core"
    finally:
        kill_alive(workers)
        rewards.close()
        prog.close()
