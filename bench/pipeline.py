"""``rtrl bench pipeline``: ingest and reward throughput against a do-nothing pipe, and the
reward close latency, on a private embedded broker + Redis (free ports, temp dir).

In one run:
(a) ceiling: a kafka-python process that consumes each raw record and produces it again
    (no parsing, plain consumer group, commit after each flushed batch);
(b) events/s of one ``rtrl serve ingest`` process (raw -> events, the same records) and
    of one ``rtrl serve reward`` process (the events ingest forwarded), each as a ratio to (a);
    with ``--client librdkafka`` also (a) as a confluent-kafka (librdkafka) process and (b)
    with ``RTRL_KAFKA__CLIENT=librdkafka``, each client's workers as a ratio to its own pipe,
    kafka-python's beside them;
(c) p50/p99 from producing the event that closes a window (the last persistence report)
    to its reward record being readable (read_committed) on the rewards topic, with events
    produced at half the reward worker's measured rate.

Throughput is measured from the consumer group's committed offsets on the input topic:
(offsets committed at the end - at the first commit) / time between them, so process
start-up and group join are excluded alike for all three.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kafka import KafkaAdminClient, KafkaProducer

from deployer.adapters.group_lag import committed_offsets
from ingest.events import CompletionServed, EditAccepted, EditPersistence, ModelRef
from services.runtime.event_producer import EventProducer
from services.runtime.kafka_io import ensure_topics, make_consumer, make_producer
from services.settings.model import KafkaSettings, RedisSettings, Settings, TopicSettings
from services.stack.embedded import EmbeddedStack, free_port

PIPE = textwrap.dedent("""
    import sys
    from kafka import KafkaConsumer, KafkaProducer
    boot, src, dst, group = sys.argv[1:5]
    c = KafkaConsumer(src, bootstrap_servers=boot, group_id=group, enable_auto_commit=False,
                      auto_offset_reset="earliest", max_poll_records=500)
    p = KafkaProducer(bootstrap_servers=boot, acks="all", linger_ms=5, enable_idempotence=True)
    while True:
        for recs in c.poll(timeout_ms=200).values():
            for r in recs:
                p.send(dst, value=r.value, key=r.key, headers=r.headers)
        p.flush()
        c.commit()
""")

PIPE_RDKAFKA = textwrap.dedent("""
    import sys
    import confluent_kafka as ck
    boot, src, dst, group = sys.argv[1:5]
    c = ck.Consumer({"bootstrap.servers": boot, "group.id": group, "enable.auto.commit": False,
                     "auto.offset.reset": "earliest"})
    c.subscribe([src])
    p = ck.Producer({"bootstrap.servers": boot, "acks": "all", "linger.ms": 5, "enable.idempotence": True})
    while True:
        msgs = [m for m in c.consume(500, 0.2) if m.error() is None]
        for m in msgs:
            while True:
                try:
                    p.produce(dst, value=m.value(), key=m.key(), headers=m.headers())
                    break
                except BufferError:
                    p.poll(0.05)
        p.flush()
        if msgs:
            c.commit(asynchronous=False)
""")
PIPES = {"kafka-python": PIPE, "librdkafka": PIPE_RDKAFKA}
"""The do-nothing pipe of each client."""

KEY_ID = "bench"


def request_events(rid: str, now: datetime) -> list[Any]:
    """A served edit, accepted, with persistence at every default horizon (5 events)."""
    served = CompletionServed(
        event_id=f"{rid}-s", request_id=rid, ts=now, session_id="s", user_key=f"u{hash(rid) % 97}",
        model=ModelRef(name="rtrl-policy", version="1"), arm="stable",
        prompt_tokens=list(range(32)), completion_tokens=list(range(16)), logprobs=[-0.5] * 16,
        latency_ms=800.0,
    )
    out: list[Any] = [served, EditAccepted(event_id=f"{rid}-a", request_id=rid, ts=now, inserted_chars=80)]
    out += [EditPersistence(event_id=f"{rid}-p{h}", request_id=rid, ts=now, horizon_s=h,
                            retained_chars=60, inserted_chars=80) for h in (30, 600, 3600)]
    return out


class Bench:
    def __init__(self, stack: EmbeddedStack, workdir: Path) -> None:
        self.stack = stack
        self.workdir = workdir
        self.secret = secrets.token_hex(16)
        self.settings = Settings(
            kafka=KafkaSettings(bootstrap_servers=stack.kafka_bootstrap),
            redis=RedisSettings(url=stack.redis_url, key_prefix="bench:"),
            topics=TopicSettings(raw="b.raw", events="b.events", rewards="b.rewards", dlq="b.dlq",
                                 partitions=4),
        )
        ensure_topics(self.settings, ["b.raw", "b.events", "b.rewards", "b.dlq", "b.pipe",
                                      "lat.events", "lat.rewards"])
        self.admin = KafkaAdminClient(**self.settings.kafka.client_kwargs())

    def env(self, **extra: str) -> dict[str, str]:
        t = self.settings.topics
        env = {k: v for k, v in os.environ.items() if not k.startswith("RTRL_")}
        env.update({
            "RTRL_STACK__DATA_DIR": str(self.workdir),
            "RTRL_KAFKA__BOOTSTRAP_SERVERS": self.stack.kafka_bootstrap,
            "RTRL_REDIS__URL": self.stack.redis_url, "RTRL_REDIS__KEY_PREFIX": "bench:",
            "RTRL_TOPICS__RAW": t.raw, "RTRL_TOPICS__EVENTS": t.events,
            "RTRL_TOPICS__REWARDS": t.rewards, "RTRL_TOPICS__DLQ": t.dlq,
            "RTRL_AUTH__KEYS": json.dumps({KEY_ID: self.secret}), "RTRL_LOG_LEVEL": "WARNING",
        })
        env.update(extra)
        return env

    def spawn(self, argv: list[str], env: dict[str, str], name: str) -> subprocess.Popen[bytes]:
        with open(self.workdir / f"{name}.log", "ab") as out:
            return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)

    def rtrl(self, *args: str, env: dict[str, str], name: str) -> subprocess.Popen[bytes]:
        return self.spawn([str(Path(sys.executable).parent / "rtrl"), *args], env, name)

    def committed(self, group: str, topic: str) -> int:
        return sum(committed_offsets(self.admin, group, topic).values())

    def measure(self, group: str, topic: str, total: int, proc: subprocess.Popen[bytes],
                timeout_s: float) -> float:
        """Events/s from the group's committed offsets (see the module doc)."""
        first: tuple[float, int] | None = None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{group} exited with {proc.returncode}; see {self.workdir}")
            n = self.committed(group, topic)
            now = time.monotonic()
            if n > 0 and first is None:
                first = (now, n)
            if n >= total and first is not None:
                if n == first[1]:
                    raise RuntimeError("everything was committed in one batch: use more --events")
                return (n - first[1]) / (now - first[0])
            time.sleep(0.05)
        raise TimeoutError(f"{group}: {self.committed(group, topic)} of {total} committed in {timeout_s}s")

    def produce_raw(self, n_requests: int) -> int:
        now = datetime.now(UTC)
        n = 0
        with EventProducer(self.settings, key_id=KEY_ID, secret=self.secret) as prod:
            for i in range(n_requests):
                for ev in request_events(f"b{i}", now):
                    prod.send(ev)
                    n += 1
            prod.flush()
        return n

    def stop(self, proc: subprocess.Popen[bytes]) -> None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _read_arrivals(kafka: KafkaSettings, arrived: dict[str, float], done: threading.Event) -> None:
    """Until ``done``: request id -> wall time its reward record became readable on lat.rewards."""
    c = make_consumer(kafka, None, ["lat.rewards"], auto_offset_reset="earliest", fetch_max_wait_ms=10)
    while not done.is_set():
        for recs in c.poll(timeout_ms=50).values():
            t = time.time()
            for r in recs:
                arrived[r.key.decode()] = t
    c.close()


def _warm_up(bench: Bench, prod: KafkaProducer, worker: subprocess.Popen[bytes],
             arrived: Mapping[str, float]) -> None:
    """One request, waited for until its reward arrives, so start-up and group join are excluded."""
    now = datetime.now(UTC)
    for ev in request_events("warm", now):
        prod.send("lat.events", value=ev.model_dump_json().encode(), key=ev.request_id.encode())
    prod.flush()
    deadline = time.monotonic() + 120
    while "warm" not in arrived:
        if time.monotonic() > deadline or worker.poll() is not None:
            raise RuntimeError(f"latency worker did not start; see {bench.workdir}")
        time.sleep(0.05)


def _payloads(n_requests: int) -> list[tuple[bytes, list[bytes]]]:
    """(key, event values) per request, serialised up front: the bench's own CPU must not starve
    the worker it measures."""
    stamp = datetime.now(UTC)
    return [
        (f"l{i}".encode(), [ev.model_dump_json().encode() for ev in request_events(f"l{i}", stamp)])
        for i in range(n_requests)
    ]


def _send_paced(prod: KafkaProducer, payloads: list[tuple[bytes, list[bytes]]], interval: float,
                duration_s: float) -> dict[str, float]:
    """One request every ``interval`` s for at most ``duration_s``: request id -> wall time its
    closing event (the last) was sent."""
    sent: dict[str, float] = {}
    t_next = time.monotonic()
    i = 0
    end = time.monotonic() + duration_s
    while time.monotonic() < end and i < len(payloads):
        key, values = payloads[i]
        for value in values[:-1]:
            prod.send("lat.events", value=value, key=key)
        sent[key.decode()] = time.time()
        prod.send("lat.events", value=values[-1], key=key)
        i += 1
        t_next += interval
        pause = t_next - time.monotonic()
        if pause > 0:
            prod.flush()
            time.sleep(pause)
    prod.flush()
    return sent


def latency(bench: Bench, rate: float, duration_s: float) -> list[float]:
    """Close latencies (s) with events produced at ``rate`` events/s for ``duration_s``."""
    s = bench.settings
    env = bench.env(RTRL_TOPICS__EVENTS="lat.events", RTRL_TOPICS__REWARDS="lat.rewards")
    worker = bench.rtrl("serve", "reward", "--group-id", "lat-reward", "--instance-id", "lat-0",
                        env=env, name="latency-reward")
    arrived: dict[str, float] = {}
    done = threading.Event()
    reader = threading.Thread(target=_read_arrivals, args=(s.kafka, arrived, done), daemon=True)
    reader.start()
    prod = make_producer(s.kafka, linger_ms=1)
    try:  # an interrupted bench stops its worker too
        _warm_up(bench, prod, worker, arrived)
        per_request = 5
        payloads = _payloads(int(rate * duration_s / per_request) + 1)
        sent = _send_paced(prod, payloads, per_request / rate, duration_s)
        deadline = time.monotonic() + 30
        while len([r for r in sent if r in arrived]) < len(sent) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        done.set()
        reader.join(5)
        prod.close()
        bench.stop(worker)
    missing = [r for r in sent if r not in arrived]
    if missing:
        raise RuntimeError(f"{len(missing)} of {len(sent)} rewards never arrived")
    return [arrived[r] - sent[r] for r in sent]


def pct(values: list[float], q: float) -> float:
    vals = sorted(values)
    return vals[min(len(vals) - 1, round(q * (len(vals) - 1)))]


def throughput(bench: Bench, client: str, n: int) -> dict[str, float]:
    """Events/s of ``client``'s do-nothing pipe and of one ingest and one reward worker on it,
    each worker as a ratio to the pipe. Each client's workers keep their own Redis keys, so
    neither sees the other's events as duplicates."""
    tag = "" if client == "kafka-python" else "-rd"
    env = bench.env(RTRL_KAFKA__CLIENT=client, RTRL_REDIS__KEY_PREFIX=f"bench{tag}:")
    out: dict[str, float] = {}
    pipe = bench.spawn([sys.executable, "-c", PIPES[client], bench.stack.kafka_bootstrap, "b.raw",
                        "b.pipe", f"pipe{tag}"], env, f"pipe{tag}")
    try:
        out["pipe_eps"] = bench.measure(f"pipe{tag}", "b.raw", n, pipe, 600)
    finally:
        bench.stop(pipe)
    for kind, topic in (("ingest", "b.raw"), ("reward", "b.events")):
        proc = bench.rtrl("serve", kind, "--group-id", f"{kind}{tag}", "--instance-id", f"{kind}{tag}-0",
                          env=env, name=f"{kind}{tag}")
        try:
            out[f"{kind}_eps"] = bench.measure(f"{kind}{tag}", topic, n, proc, 600)
        finally:
            bench.stop(proc)
        out[f"{kind}_ratio"] = out[f"{kind}_eps"] / out["pipe_eps"]
    return out


def run(n_events: int, latency_s: float, client: str = "kafka-python") -> dict[str, Any]:
    """The figures of the module doc; with ``client="librdkafka"`` for both clients (the
    kafka-python ones at the top level, as without it, and librdkafka's under ``librdkafka``)."""
    workdir = Path(tempfile.mkdtemp(prefix="rtrl-bench-"))
    stack = EmbeddedStack(data_dir=workdir / "stack", kafka_port=free_port(), redis_port=free_port(),
                          reuse_redis_url=None, with_mlflow=False).up(timeout_s=90)
    try:
        bench = Bench(stack, workdir)
        n = bench.produce_raw(max(1, n_events // 5))
        out: dict[str, Any] = {"events": n, **throughput(bench, "kafka-python", n)}
        if client == "librdkafka":
            out["librdkafka"] = throughput(bench, "librdkafka", n)
        out["latency_rate_eps"] = out["reward_eps"] / 2
        lat = latency(bench, out["latency_rate_eps"], latency_s)
        out["latency_n"] = len(lat)
        out["close_p50_s"] = statistics.median(lat)
        out["close_p99_s"] = pct(lat, 0.99)
        out["close_max_s"] = max(lat)
        return out
    finally:
        stack.down()


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="rtrl bench pipeline", description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=20_000, help="events per throughput run")
    ap.add_argument("--latency-seconds", type=float, default=15.0, help="duration of the latency run")
    ap.add_argument("--client", choices=sorted(PIPES), default="kafka-python",
                    help="librdkafka: also the workers on librdkafka against a librdkafka pipe")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = ap.parse_args(argv)
    r = run(args.events, args.latency_seconds, args.client)
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    ok_i, ok_r = r["ingest_ratio"] >= 0.5, r["reward_ratio"] >= 0.5
    ok_l = r["close_p99_s"] < 1.0
    print(f"rtrl bench pipeline: {r['events']} events (requests of 5 events), "
          "one process each, embedded broker")
    print(f"{'stage':36s} {'events/s':>10s} {'vs pipe':>8s}  target")
    print(f"{'(a) do-nothing kafka-python pipe':36s} {r['pipe_eps']:10.0f} {1.0:8.2f}")
    print(f"{'(b) rtrl serve ingest':36s} {r['ingest_eps']:10.0f} {r['ingest_ratio']:8.2f}  "
          f">= 0.5 {'ok' if ok_i else 'MISSED'}")
    print(f"{'(b) rtrl serve reward':36s} {r['reward_eps']:10.0f} {r['reward_ratio']:8.2f}  "
          f">= 0.5 {'ok' if ok_r else 'MISSED'}")
    rd = r.get("librdkafka")
    if rd is not None:
        print(f"{'(a) do-nothing librdkafka pipe':36s} {rd['pipe_eps']:10.0f} {1.0:8.2f}")
        for kind in ("ingest", "reward"):
            ok = rd[f"{kind}_ratio"] >= 0.5
            print(f"{'(b) rtrl serve ' + kind + ' on librdkafka':36s} {rd[f'{kind}_eps']:10.0f} "
                  f"{rd[f'{kind}_ratio']:8.2f}  >= 0.5 {'ok' if ok else 'MISSED'}")
    print(f"(c) close -> reward record at {r['latency_rate_eps']:.0f} events/s ({r['latency_n']} windows): "
          f"p50 {r['close_p50_s'] * 1000:.0f} ms, p99 {r['close_p99_s'] * 1000:.0f} ms, "
          f"max {r['close_max_s'] * 1000:.0f} ms  (target p99 < 1 s: {'ok' if ok_l else 'MISSED'})")
    return 0
