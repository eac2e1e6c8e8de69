"""``rtrl serve ingest`` as a real process: clean SIGTERM, and kill -9 without loss or duplicates."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from kafka import KafkaConsumer, TopicPartition

from ingest.events import parse_event
from services.runtime.event_producer import EventProducer
from services.runtime.kafka_io import ensure_topics, make_consumer
from services.settings.model import Settings
from tests.service_env import service_env

sys.path.insert(0, str(Path(__file__).parent))
from test_ingest_service import SECRET, accepted, committed_total, read_all, served, with_auth


@pytest.fixture
def settings(isolated_settings: Settings) -> Settings:
    """These tests SIGKILL workers: they get a broker and Redis of their own (conftest)."""
    return isolated_settings


RTRL = str(Path(sys.executable).parent / "rtrl")


def env_for(settings: Settings, tmp_path: Path, **extra: str) -> dict[str, str]:
    return service_env(settings, tmp_path / "no-stack", **{
        "RTRL_AUTH__KEYS": json.dumps({"gw": SECRET}),
        "RTRL_INGEST__GROUP_ID": settings.ingest.group_id,
        "RTRL_INGEST__POLL_TIMEOUT_MS": "100",
        **extra,
    })


def start(settings: Settings, tmp_path: Path, *args: str, **extra: str) -> tuple[subprocess.Popen[str], int]:
    """Start a worker; return it and its metrics port (read from its first stdout line)."""
    proc = subprocess.Popen(
        [RTRL, "serve", "ingest", "--port", "0", *args],
        env=env_for(settings, tmp_path, **extra), cwd=tmp_path, text=True,
        stdout=subprocess.PIPE, stderr=open(tmp_path / f"ingest-{time.monotonic_ns()}.log", "w"),
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert "/metrics" in line, f"unexpected first line {line!r}"
    return proc, int(line.rsplit(":", 1)[1].split("/")[0])


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def wait_ready(port: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while get(port, "/readyz")[0] != 200:
        assert time.monotonic() < deadline, get(port, "/readyz")
        time.sleep(0.1)


def end_total(consumer: KafkaConsumer, settings: Settings) -> int:
    """Records written to the events topic, committed or not (end offsets)."""
    parts = [TopicPartition(settings.topics.events, p) for p in range(settings.topics.partitions)]
    return sum(consumer.end_offsets(parts).values())


def test_sigterm_finishes_commits_and_exits_zero(settings: Settings, tmp_path: Path) -> None:
    s = with_auth(settings)
    proc, port = start(s, tmp_path, "--max-batch", "7")
    try:
        wait_ready(port)
        assert get(port, "/healthz")[0] == 200
        with EventProducer(s, "gw", SECRET) as p:
            for i in range(40):
                p.send(served(f"t-{i}"))
            p.send_raw(b"junk", key=b"j")
        assert len(read_all(s, s.topics.events, 40)) == 40
        metrics = get(port, "/metrics")[1]
        assert 'rtrl_ingest_events_total{result="valid"} 40.0' in metrics
        assert 'rtrl_ingest_rejected_total{reason="unsigned"} 1.0' in metrics
        assert 'rtrl_batch_processing_seconds_count{rtrl_service="ingest"}' in metrics
        deadline = time.monotonic() + 10
        lag_line = (f'rtrl_consumer_lag_messages{{partition="0",rtrl_service="ingest",'
                    f'topic="{s.topics.raw}"}} 0.0')
        while lag_line not in get(port, "/metrics")[1]:
            assert time.monotonic() < deadline, [
                ln for ln in get(port, "/metrics")[1].splitlines() if "lag" in ln]
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert committed_total(s) == 41


def _events_by_id(settings: Settings, expect: int) -> Counter[str]:
    recs = read_all(settings, settings.topics.events, expect, timeout_s=60, settle_s=1.0)
    return Counter(parse_event(r.value).event_id for r in recs)


@pytest.mark.reliability  # also part of scripts/reliability (trainer, deployer and worker kills)
def test_kill_9_mid_stream_then_restart_forwards_every_event_exactly_once(
    settings: Settings, tmp_path: Path
) -> None:
    s = with_auth(settings)
    extra = {"RTRL_INGEST__TRANSACTION_TIMEOUT_MS": "4000"}
    n = 6000
    expected: set[str] = set()
    ensure_topics(s)
    with EventProducer(s, "gw", SECRET) as p:
        for i in range(n // 2):
            rid = f"k-{i}"
            for ev in (served(rid), accepted(rid)):
                p.send(ev)
                expected.add(ev.event_id)
            if i % 100 == 0:
                p.send(ev)  # a retried send: must still appear once
                p.send_raw(b"{broken", key=rid.encode(), sign_value=True)

    watcher = make_consumer(s.kafka, None)
    procs: list[subprocess.Popen[str]] = []
    try:
        for kill in range(2):
            proc, _ = start(s, tmp_path, "--max-batch", "25", "--instance-id", "w0", **extra)
            procs.append(proc)
            deadline = time.monotonic() + 60
            # kill while records are flowing: after some output, before the end
            while end_total(watcher, s) < (kill + 1) * n // 4:
                assert time.monotonic() < deadline, "ingest made no progress"
                assert proc.poll() is None, "ingest exited"
                time.sleep(0.02)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
        assert committed_total(s) < n + n // 100, "the kills should land mid-stream"

        proc, _ = start(s, tmp_path, "--max-batch", "200", "--instance-id", "w0", **extra)
        procs.append(proc)
        seen = _events_by_id(s, n)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        watcher.close()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert set(seen) == expected, f"missing {len(expected - set(seen))}, extra {len(set(seen) - expected)}"
    assert max(seen.values()) == 1, [k for k, v in seen.items() if v > 1][:5]
    dlq: list[Any] = read_all(s, s.topics.dlq, n // 200, timeout_s=10)
    assert len(dlq) == n // 200
    assert {json.loads(r.value)["reason"] for r in dlq} == {"bad_json"}


def test_unreachable_redis_is_a_clear_startup_error(settings: Settings, tmp_path: Path) -> None:
    from services.stack.embedded import free_port

    s = with_auth(settings)
    env = env_for(s, tmp_path, RTRL_REDIS__URL=f"redis://:hunter2@127.0.0.1:{free_port()}/0")
    proc = subprocess.run([RTRL, "serve", "ingest", "--port", "0"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=90)
    assert proc.returncode == 2
    assert "cannot start: Redis at 127.0.0.1:" in proc.stderr
    assert "hunter2" not in proc.stderr + proc.stdout
