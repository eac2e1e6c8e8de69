"""A realistic event workload and the worker processes it flows through, for the crash
consistency test and the load soak: requests with full event sequences (edits accepted with
persistence reports, rejected edits, questions, empty completions, dissatisfied follow-ups,
feedback before the served event), invalid and hostile records, retried sends; real
``rtrl serve ingest|reward`` processes with stable instance ids; group progress and lag."""

from __future__ import annotations

import itertools
import json
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from kafka import TopicPartition

from deployer.adapters.group_lag import committed_offsets
from ingest.auth import sign
from ingest.events import (
    CompletionServed,
    EditAccepted,
    EditPersistence,
    EditRejected,
    FollowupDissatisfied,
    ModelRef,
)
from services.runtime.kafka_io import make_admin, make_consumer, make_producer
from services.settings.model import Settings
from tests.service_env import service_env

RTRL = str(Path(sys.executable).parent / "rtrl")
KEY_ID = "reliability"
SECRET = "reliability-secret-0123456789"
TIME_SCALE = 0.05
"""Reward windows: follow-up 60 s -> 3 s, due time (3600 + 30 s) -> 181.5 s. Every request of
the workload closes by its events, long before its due time."""


# ---------------------------------------------------------------------- workload
@dataclass(frozen=True)
class RawOut:
    """One record for the raw topic, ready to send."""

    value: bytes
    key: bytes | None
    headers: list[tuple[str, bytes]]
    kind: str
    """``valid``, ``retry`` (a copy of a valid record: dropped as a duplicate) or the DLQ reason."""


@dataclass
class Workload:
    records: list[RawOut]
    requests: list[str]
    """Request ids that must get exactly one reward each."""

    @property
    def retries(self) -> int:
        return sum(r.kind == "retry" for r in self.records)

    def by_kind(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.records:
            out[r.kind] = out.get(r.kind, 0) + 1
        return out


def _signed(value: bytes, key: bytes | None, kind: str, secret: str = SECRET) -> RawOut:
    headers = [("rtrl-key-id", KEY_ID.encode()), ("rtrl-signature", sign(value, secret.encode()).encode())]
    return RawOut(value, key, headers, kind)


def _request(rid: str, rng: random.Random, t0: datetime) -> list[Any]:
    """One request's events in the order its client and the gateway would send them."""
    u = rng.random()
    kind = "edit" if u < 0.72 else ("question" if u < 0.92 else "empty")
    served = CompletionServed(
        event_id=f"{rid}-s", request_id=rid, ts=t0, session_id=f"s{rng.randrange(500)}",
        user_key=f"u{rng.randrange(2000)}", model=ModelRef(name="rtrl-policy", version="3"),
        arm=rng.choice(["stable", "canary"]), prompt_tokens=[rng.randrange(5000) for _ in range(24)],
        completion_tokens=[rng.randrange(5000) for _ in range(12)],
        logprobs=[-rng.random() for _ in range(12)],
        latency_ms=rng.uniform(100, 4000), tool_calls=(tc := rng.choice([0, 0, 1, 2])),
        invalid_tool_calls=rng.randint(0, tc), completion_kind=kind,
    )
    evs: list[Any] = [served]
    t = t0

    def dissatisfied() -> FollowupDissatisfied:
        return FollowupDissatisfied(event_id=f"{rid}-d", request_id=rid, ts=t + timedelta(seconds=20))

    if kind == "edit" and rng.random() < 0.75:
        ins = rng.randint(1, 400)
        evs.append(EditAccepted(event_id=f"{rid}-a", request_id=rid, ts=t + timedelta(seconds=2),
                                inserted_chars=ins))
        if rng.random() < 0.15:
            evs.append(dissatisfied())
        kept = ins
        for h in (30, 600, 3600):
            kept = rng.randint(0, kept)
            evs.append(EditPersistence(event_id=f"{rid}-p{h}", request_id=rid, ts=t + timedelta(seconds=h),
                                       horizon_s=h, retained_chars=kept, inserted_chars=ins))
        if rng.random() < 0.1:  # the exposure log reached the broker after the client's feedback
            evs = [*evs[1:], evs[0]]
    elif kind == "edit":
        evs.append(EditRejected(event_id=f"{rid}-r", request_id=rid, ts=t + timedelta(seconds=2)))
        if rng.random() < 0.3:
            evs.append(dissatisfied())
    elif rng.random() < 0.3:
        evs.append(dissatisfied())
    return evs


def _invalid(i: int, rng: random.Random, t0: datetime) -> RawOut:
    """A record ingest must dead-letter, with the reason it must give."""
    rid = f"bad{i}"
    good = json.loads(CompletionServed(
        event_id=f"{rid}-s", request_id=rid, ts=t0, session_id="s", user_key="u",
        model=ModelRef(name="m", version="1"), arm="stable", prompt_tokens=[1], completion_tokens=[2],
        logprobs=[-0.1], latency_ms=10.0).model_dump_json())
    which = rng.randrange(8)
    key = rid.encode()
    if which == 0:
        return _signed(b'{"schema_version": 1, "event_id": "' + rid.encode(), key, "bad_json")
    if which == 1:
        return _signed(json.dumps({**good, "latency_ms": -5}).encode(), key, "invalid_field")
    if which == 2:
        doc = {k: v for k, v in good.items() if k != "request_id"}
        return _signed(json.dumps(doc).encode(), None, "missing_field")
    if which == 3:
        return _signed(json.dumps({**good, "schema_version": 2}).encode(), key, "unknown_schema_version")
    if which == 4:
        return RawOut(json.dumps(good).encode(), key, [], "unsigned")
    if which == 5:
        return _signed(json.dumps(good).encode(), key, "bad_signature", secret="not-the-secret")
    if which == 6:
        future = (datetime.now(UTC) + timedelta(days=1)).isoformat()
        return _signed(json.dumps({**good, "ts": future}).encode(), key, "ts_future")
    return _signed(json.dumps({**good, "type": "completion.teleported"}).encode(), key, "unknown_type")


def build(n_events: int, seed: int, prefix: str = "r", invalid_share: float = 0.03,
          retry_share: float = 0.01, spread: int = 30) -> Workload:
    """About ``n_events`` raw records. Each request's events are spread over the next
    ``spread`` requests' (a client reports persistence later; requests overlap), and each
    request keeps its own order."""
    rng = random.Random(seed)
    t0 = datetime.now(UTC) - timedelta(hours=2)  # the last horizon (1 h) is in the past too
    keyed: list[tuple[float, int, RawOut]] = []
    requests: list[str] = []
    n = 0
    i = 0
    seq = 0
    while n < n_events:
        rid = f"{prefix}{i}"
        evs = _request(rid, rng, t0)
        requests.append(rid)
        slot = float(i)
        for ev in evs:
            value = ev.model_dump_json().encode()
            rec = _signed(value, rid.encode(), "valid")
            keyed.append((slot, seq, rec))
            seq += 1
            n += 1
            if rng.random() < retry_share:  # a producer retry: the same bytes again, a bit later
                copy = RawOut(rec.value, rec.key, rec.headers, "retry")
                keyed.append((slot + rng.uniform(0, 2), seq, copy))
                seq += 1
                n += 1
            if rng.random() < invalid_share:
                keyed.append((slot, seq, _invalid(seq, rng, t0)))
                seq += 1
                n += 1
            slot += rng.uniform(0, spread / max(1, len(evs)))
        i += 1
    keyed.sort(key=lambda x: (x[0], x[1]))
    return Workload([r for _, _, r in keyed], requests)


def chunks(n_events: int, seed: int, requests: list[str], chunk: int = 2_000) -> Iterator[RawOut]:
    """About ``n_events`` records built ``chunk`` at a time (a long soak does not hold them
    all in memory); the request ids of every chunk built are appended to ``requests``."""
    k = 0
    left = n_events
    while left > 0:
        wl = build(min(chunk, left), seed + k, prefix=f"c{k}-")
        requests.extend(wl.requests)
        left -= len(wl.records)
        k += 1
        yield from wl.records


class Streamer(threading.Thread):
    """Sends a workload's records to the raw topic at a fixed rate (records/s)."""

    def __init__(self, settings: Settings, records: Iterable[RawOut], rate: float) -> None:
        super().__init__(daemon=True)
        self.settings, self.records, self.rate = settings, records, rate
        self.sent = 0
        self.error: BaseException | None = None
        self.started_at = 0.0
        self.finished_at = 0.0

    def run(self) -> None:
        try:
            prod = make_producer(self.settings.kafka, linger_ms=20)
            records = iter(self.records)
            head = next(records, None)  # a generator builds its first chunk before the clock starts
            self.started_at = time.monotonic()
            topic = self.settings.topics.raw
            for i, r in enumerate(itertools.chain([] if head is None else [head], records)):
                self.send(prod, topic, r)
                self.sent = i + 1
                ahead = self.started_at + (i + 1) / self.rate - time.monotonic()
                if ahead > 0:
                    time.sleep(ahead)
            self.finish(prod, topic)
            prod.close()
            self.finished_at = time.monotonic()
        except BaseException as exc:  # reported by the test
            self.error = exc

    def send(self, prod: Any, topic: str, r: RawOut) -> None:
        prod.send(topic, value=r.value, key=r.key, headers=r.headers)

    def finish(self, prod: Any, topic: str) -> None:
        prod.flush()


# ---------------------------------------------------------------------- processes
CLIENTS = ("kafka-python", "librdkafka")
"""The Kafka clients of the exactly-once workers (``RTRL_KAFKA__CLIENT``): every check that
runs workers runs on both."""


def env_for(settings: Settings, tmp: Path, **extra: str) -> dict[str, str]:
    return service_env(settings, tmp / "no-stack", **{
        "RTRL_AUTH__KEYS": json.dumps({KEY_ID: SECRET}),
        "RTRL_INGEST__GROUP_ID": settings.ingest.group_id,
        "RTRL_REWARD__GROUP_ID": settings.reward.group_id,
        "RTRL_INGEST__POLL_TIMEOUT_MS": "100",
        "RTRL_REWARD__TIME_SCALE": str(TIME_SCALE),
        **extra,
    })


def rss_of(pid: int) -> int | None:
    """Resident set size of a process, from /proc (psutil is not a dependency)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return None


@dataclass
class Worker:
    """One ``rtrl serve ingest|reward`` process with a stable instance id (restarts reuse it:
    noida-db never evicts a SIGKILLed member, docs/ingest.md)."""

    kind: str
    instance: str
    env: dict[str, str]
    log: Path
    args: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    def start(self) -> Worker:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [RTRL, "serve", self.kind, "--port", "0", "--instance-id", self.instance, *self.args],
                env=self.env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.starts += 1
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self, timeout_s: float = 30) -> int:
        """SIGTERM; the exit code (SIGKILL after ``timeout_s``: -9)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)

    def partitions(self) -> list[int]:
        """The input partitions of its last assignment, from its log (the exactly-once
        loop logs ``rtrl.<kind>: assigned <topic>[0], <topic>[1]``)."""
        last: list[int] = []
        for line in self.log.read_text(errors="replace").splitlines():
            if f"rtrl.{self.kind}: assigned " in line:
                last = [int(x) for x in re.findall(r"\[(\d+)\]", line.split(" assigned ", 1)[1])]
        return last

    def owned_partitions(self, timeout_s: float = 60.0) -> list[int]:
        """Its input partitions once it owns some: a worker mid-rebalance (another member just
        restarted) or still joining its group owns nothing for a moment. Fails, with its log's
        tail, when it owns nothing for ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not (parts := self.partitions()):
            assert self.alive(), f"died on its own:\n{self.obituary()}"
            assert time.monotonic() < deadline, (
                f"{self.instance} owned no partition for {timeout_s:.0f} s:\n{self.obituary()}")
            time.sleep(0.2)
        return parts

    def rss_bytes(self) -> int | None:
        return rss_of(self.pid)

    def obituary(self, lines: int = 40) -> str:
        """Why it is not running, for a failure message: its exit code and its log's last lines
        (a test that only names the log leaves nothing to read once the run's files are gone)."""
        code = None if self.proc is None else self.proc.poll()
        text = self.log.read_text(errors="replace") if self.log.exists() else "(no log)"
        tail = "\n".join(text.splitlines()[-lines:])
        return f"--- {self.instance} (exit {code}, started {self.starts}x), {self.log}:\n{tail}"


def deaths(workers: Iterable[Worker]) -> str:
    """The obituaries of whichever of ``workers`` are not running ('' when all are)."""
    return "\n".join(w.obituary() for w in workers if not w.alive())


# ---------------------------------------------------------------------- progress and lag
def wait_up(workers: Iterable[Worker], timeout_s: float = 120.0) -> None:
    """Wait until every worker has logged ``worker up``; fail if one exits first or time runs out."""
    workers = list(workers)
    deadline = time.monotonic() + timeout_s
    while not all(w.log.exists() and "worker up" in w.log.read_text() for w in workers):
        assert not deaths(workers), f"exited at start-up:\n{deaths(workers)}"
        assert time.monotonic() < deadline, f"workers did not start; see {workers[0].log.parent}"
        time.sleep(0.2)


def kill_alive(workers: Iterable[Worker]) -> None:
    """SIGKILL whichever of ``workers`` still runs (a test's clean-up)."""
    for w in workers:
        if w.alive():
            w.kill()


class Progress:
    """Consumer groups' committed offsets and topics' end offsets."""

    def __init__(self, settings: Settings) -> None:
        self.s = settings
        self.admin = make_admin(settings.kafka)
        self.consumer = make_consumer(settings.kafka, None)
        n = settings.topics.partitions
        self._tps = {t: [TopicPartition(t, p) for p in range(n)]
                     for t in (settings.topics.raw, settings.topics.events, settings.topics.rewards)}

    def committed_by_partition(self, group: str, topic: str) -> dict[int, int]:
        return committed_offsets(self.admin, group, topic)

    def committed(self, group: str, topic: str) -> int:
        return sum(self.committed_by_partition(group, topic).values())

    def input_of(self, kind: str) -> tuple[str, str]:
        """(group, input topic) of a worker kind."""
        if kind == "ingest":
            return self.s.ingest.group_id, self.s.topics.raw
        return self.s.reward.group_id, self.s.topics.events

    def end_by_partition(self, topic: str) -> dict[int, int]:
        return {tp.partition: off for tp, off in self.consumer.end_offsets(self._tps[topic]).items()}

    def end(self, topic: str) -> int:
        """Sum of the end offsets (read_committed consumer: the last stable offsets)."""
        return sum(self.consumer.end_offsets(self._tps[topic]).values())

    def ingest_committed(self) -> int:
        return self.committed(self.s.ingest.group_id, self.s.topics.raw)

    def reward_committed(self) -> int:
        return self.committed(self.s.reward.group_id, self.s.topics.events)

    def lags(self) -> tuple[int, int]:
        """Records behind: ingest on the raw topic, reward on the events topic. The events
        topic is transactional, so the reward figure also counts up to one commit marker per
        partition after its last record."""
        return (max(0, self.end(self.s.topics.raw) - self.ingest_committed()),
                max(0, self.end(self.s.topics.events) - self.reward_committed()))

    def close(self) -> None:
        self.admin.close()
        self.consumer.close()


class RewardCounter:
    """Reads the rewards topic (read_committed) incrementally: request id -> records."""

    def __init__(self, settings: Settings) -> None:
        self.c = make_consumer(settings.kafka, None, [settings.topics.rewards])
        self.counts: dict[str, int] = {}

    def poll(self, timeout_ms: int = 200) -> int:
        for recs in self.c.poll(timeout_ms=timeout_ms, max_records=5000).values():
            for r in recs:
                rid = r.key.decode()
                self.counts[rid] = self.counts.get(rid, 0) + 1
        return len(self.counts)

    def close(self) -> None:
        self.c.close()


def drain_and_stop(workers: list[Worker], rewards: RewardCounter, requests: int,
                   timeout_s: float) -> tuple[float, dict[str, int]]:
    """Wait until every request is rewarded (or ``timeout_s``; the reconciler then says why),
    a few seconds more so a duplicate would show, then SIGTERM every worker. Returns the
    drain time and each worker's exit code. A worker that dies meanwhile fails the test."""
    t0 = time.monotonic()
    while rewards.poll(200) < requests and time.monotonic() < t0 + timeout_s:
        assert not deaths(workers), f"died while draining:\n{deaths(workers)}"
    drain_s = time.monotonic() - t0
    settle = time.monotonic() + 3
    while time.monotonic() < settle:
        rewards.poll(200)
    return drain_s, {w.instance: w.stop() for w in workers}


def reconcile_topics(settings: Settings) -> tuple[Any, Any]:
    """The reconciler's inputs read from ``settings``' topics, and its report."""
    from ingest.reward.reconcile import reconcile
    from services.cli.reconcile import read_inputs

    inp = read_inputs(settings)
    rep = reconcile(inp.raw, inp.forwarded, inp.dlq, inp.rewards, raw_topic=settings.topics.raw,
                    ingest_committed=inp.ingest_committed, reward_committed=inp.reward_committed)
    return inp, rep


def reconcile_figures(rep: Any) -> dict[str, Any]:
    """The reconciler's accounting as recorded figures (the same keys in every test)."""
    return {
        "lost_events": len(rep.raw_lost),
        "lost_rewards": len(rep.lost_rewards),
        "duplicate_events": len(rep.duplicate_forwarded),
        "duplicate_rewards": len(rep.duplicate_rewards),
        "dlq": rep.raw_dead_lettered,
        "reward_records": rep.reward_records,
        "all_events_reflected": rep.all_reflected,
    }


def pct(values: list[float], q: float) -> float:
    vals = sorted(values)
    return vals[min(len(vals) - 1, round(q * (len(vals) - 1)))] if vals else float("nan")
