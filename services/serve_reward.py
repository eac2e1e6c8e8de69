"""``rtrl serve reward``: join each request's events and emit exactly one reward record.

Per polled batch of the events topic (one loop iteration):

1. **Apply** the events to their windows in Redis (``ingest.reward.join``; idempotent by event_id,
   so a replayed batch changes nothing). Events of already-emitted requests are *late*:
   counted, never re-emitted.
2. **Close** the windows that are due (or closable early) on the partitions this worker
   owns, read from the per-partition due sets in Redis. Timers fire without new events:
   the poll waits at most ``poll_timeout_ms``.
3. **Commit** in one Kafka transaction: the reward records (to the rewards topic, same
   partition number as the events partition, key = request_id) and the consumed offsets
   of the events topic (``send_offsets_to_transaction`` with the consumer's group metadata,
   so a fenced, stale worker cannot commit).
4. **Mark** those requests emitted in Redis, delete their windows and timers, and advance
   the partition's rewards-topic checkpoint (one atomic MULTI).

Crash anywhere and the restarted worker (or whichever worker gets the partition) repeats
from the last committed offsets: before 3, nothing was visible and the Redis writes of 1
are replayed idempotently; between 3 and 4 the rewards are out but Redis does not know, so
on every partition assignment the worker first waits until the rewards partition has no
open transaction (last stable offset = high watermark), reads it (read_committed) from the
Redis checkpoint to its end, and marks every request id it finds as emitted. Only then
does it apply or close anything on that partition. Hence exactly one reward per request.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import random
import signal
import socket
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import redis
from kafka import ConsumerRebalanceListener, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.errors import KafkaError
from kafka.structs import OffsetAndMetadata
from pydantic import ValidationError

from ingest.adapters.redis_join import RedisJoinState
from ingest.events import Event, parse_event
from ingest.reward.join import Window, apply_batch, close, close_at
from ingest.reward.spec import RewardSpec, load_spec
from services.runtime import metrics as m
from services.runtime.health import Health, HttpEndpoints
from services.runtime.kafka_io import (
    Backoff,
    check_sent,
    close_quietly,
    end_transaction,
    ensure_topics,
    make_consumer,
    make_producer,
    send_offsets,
    wait_for_broker,
)
from services.runtime.process import Stopper, setup_logging
from services.runtime.redis_io import make_redis
from services.runtime.settings import Settings, get_settings

log = logging.getLogger("rtrl.reward")
SERVICE = "reward"

# Test-only fault injection: "<point>:<probability>", point in after_apply | mid_txn |
# after_commit. The process SIGKILLs itself there, as an OOM kill or node loss would.
_CRASH_ENV = "RTRL_TEST_REWARD_CRASH"
TXN_TIMEOUT_S = 10.0
"""Longest wait for a transaction's sends, offsets or commit before it counts as failed."""


@dataclass
class _Outgoing:
    partition: int
    request_id: str
    value: bytes
    close_time: float
    arm: str
    defaulted: bool
    reward: float


@dataclass
class BatchStats:
    events: int = 0
    late: int = 0
    emitted: int = 0
    orphans: int = 0
    recovered: int = 0
    emitted_ids: list[str] = field(default_factory=list)


class _Listener(ConsumerRebalanceListener):
    def __init__(self, worker: RewardWorker) -> None:
        self.worker = worker

    def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        for tp in revoked:
            self.worker.pending_recovery.discard(tp.partition)
        log.info("partitions revoked: %s", sorted(tp.partition for tp in revoked))

    def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        parts = sorted(tp.partition for tp in assigned)
        self.worker.pending_recovery.update(parts)
        log.info("partitions assigned: %s (recovering from the rewards topic first)", parts)


class RewardWorker:
    """One reward worker process: a consumer-group member with a transactional producer."""

    def __init__(self, settings: Settings, spec: RewardSpec, health: Health | None = None) -> None:
        self.s = settings
        self.cfg = settings.reward
        self.spec = spec
        self.health = health or Health()
        self.pending_recovery: set[int] = set()
        self.state = RedisJoinState(make_redis(settings.redis), settings.redis.key_prefix,
                                    self.cfg.emitted_ttl_s)
        self._crash = _parse_crash(os.environ.get(_CRASH_ENV))
        self._last_lag = 0.0
        self._ok = {"kafka": False, "redis": False}
        self.consumer: KafkaConsumer | None = None
        self.producer: KafkaProducer | None = None
        self._committed_reader: KafkaConsumer | None = None
        self._uncommitted_reader: KafkaConsumer | None = None
        self._orphan_counts: dict[str, int] = {}
        self._futures: list[tuple[int, Any]] = []

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> RewardWorker:
        s = self.s
        wait_for_broker(s.kafka)
        ensure_topics(s, [s.topics.events, s.topics.rewards])
        self.state.r.ping()
        member: dict[str, Any] = {}
        if self.cfg.group_instance_id:
            member["group_instance_id"] = self.cfg.group_instance_id
        # a short broker-side fetch wait keeps the loop (and its timers) turning under light load
        self.consumer = make_consumer(s.kafka, self.cfg.group_id, max_poll_records=self.cfg.max_batch,
                                      fetch_max_wait_ms=50, **member)
        self.consumer.subscribe([s.topics.events], listener=_Listener(self))
        self._check_partitions()
        txid = self._open_producer()
        self._committed_reader = make_consumer(s.kafka, None)
        self._uncommitted_reader = make_consumer(s.kafka, None, isolation_level="read_uncommitted")
        self.health.add_check("kafka", lambda: self._ok["kafka"])
        self.health.add_check("redis", lambda: self._ok["redis"])
        self.health.add_check("assigned", lambda: bool(self.owned()))
        log.info("reward worker up: spec %s, group %s, transactional id %s, time scale %g",
                 self.spec.version, self.cfg.group_id, txid, self.cfg.time_scale)
        return self

    def _open_producer(self) -> str:
        """A transactional producer under a fresh transactional id, after fencing the last one.

        With a stable base id (``transactional_id`` or ``group_instance_id``) every producer
        this replica opens gets the next generation ``<base>-<n>`` (a counter in Redis), and
        first fences ``<base>-<n-1>``: that aborts a transaction a killed predecessor left
        open at once. A fresh id per producer also means a fresh producer id, so an aborted
        transaction is never followed by committed data of the same producer id (some
        Kafka-protocol brokers, noida-db among them, list stale aborted transactions in fetch
        responses, which makes read_committed clients skip such data).
        """
        base = self.cfg.transactional_id or self.cfg.group_instance_id
        if base:
            key = f"{self.s.redis.key_prefix}reward:txgen:{base}"
            previous = self.state.r.get(key)
            gen = int(self.state.r.incr(key))
            if previous is not None:
                fence = self._make_producer(f"{base}-{int(previous)}")
                fence.close(timeout=5)
            txid = f"{base}-{gen}"
        else:
            txid = f"rtrl-reward-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        close_quietly(self.producer)
        self.producer = None
        self.producer = self._make_producer(txid)
        return txid

    def _make_producer(self, txid: str) -> KafkaProducer:
        prod = make_producer(
            self.s.kafka, transactional_id=txid, transaction_timeout_ms=self.cfg.transaction_timeout_ms,
            linger_ms=2, batch_size=256 * 1024, max_request_size=8 * 1024 * 1024,
        )
        prod.init_transactions()  # fences older producers of txid, aborting their open transaction
        return prod

    def _check_partitions(self) -> None:
        assert self.consumer is not None
        ev = self.consumer.partitions_for_topic(self.s.topics.events) or set()
        rw = self.consumer.partitions_for_topic(self.s.topics.rewards) or set()
        if len(rw) < len(ev):
            raise SystemExit(
                f"topic {self.s.topics.rewards} has {len(rw)} partitions but {self.s.topics.events} "
                f"has {len(ev)}: the rewards topic needs at least as many (rewards of events "
                "partition p go to rewards partition p)")

    def close(self) -> None:
        for c in (self.consumer, self._committed_reader, self._uncommitted_reader):
            if c is not None:
                c.close(autocommit=False)
        if self.producer is not None:
            self.producer.close(timeout=5)

    def owned(self) -> list[int]:
        if self.consumer is None:
            return []
        return sorted(tp.partition for tp in self.consumer.assignment() if tp.topic == self.s.topics.events)

    def run(self, stopper: Stopper) -> None:
        run_loop(self, stopper)

    # ------------------------------------------------------------------ one iteration
    def run_once(self) -> BatchStats:
        assert self.consumer is not None and self.producer is not None
        polled = self.consumer.poll(timeout_ms=self.cfg.poll_timeout_ms, max_records=self.cfg.max_batch)
        self._ok["kafka"] = True
        self.health.beat()
        t0 = time.perf_counter()
        stats = BatchStats()
        if self.pending_recovery:
            stats.recovered = self._recover(sorted(self.pending_recovery))
        events, partition_of, offsets = self._decode(polled)
        stats.events = len(events)
        now = time.time()
        changed: dict[str, Window] = {}
        closes: dict[str, float] = {}
        if events:
            windows, emitted = self.state.load(e.request_id for e in events)
            res = apply_batch(windows, emitted, events, now, self.spec)
            for ev in res.late:
                m.REWARD_LATE.labels(ev.type).inc()
            stats.late = len(res.late)
            changed = res.windows
            closes = {rid: close_at(w, self.spec, self.cfg.time_scale) for rid, w in changed.items()}
        owned = [p for p in self.owned() if p not in self.pending_recovery]
        due = self.state.save_and_due(changed, partition_of, closes, owned, now, self.cfg.max_close_per_batch)
        self._maybe_crash("after_apply")
        out, orphans, stale = self._closable(due, changed, now)
        if offsets or out:
            self._commit(out, offsets)
        ckpts = self._checkpoints(out)
        self.state.finish([(o.partition, o.request_id) for o in out], orphans, stale, ckpts)
        self._ok["redis"] = True
        done_t = time.time()
        for o in out:
            m.REWARDS_EMITTED.labels(o.arm, str(o.defaulted).lower()).inc()
            m.REWARD_VALUE.labels(o.arm).observe(o.reward)
            m.REWARD_CLOSE_SECONDS.observe(max(0.0, done_t - o.close_time))
        if orphans:
            m.REWARD_ORPHANS.inc(sum(n for n in self._orphan_counts.values()))
        stats.emitted, stats.orphans = len(out), len(orphans)
        stats.emitted_ids = [o.request_id for o in out]
        if events or out:
            m.BATCH_SECONDS.labels(SERVICE).observe(time.perf_counter() - t0)
        self._gauges(done_t)
        return stats

    def _decode(self, polled: dict[TopicPartition, list[Any]]
                ) -> tuple[list[Event], dict[str, int], dict[TopicPartition, OffsetAndMetadata]]:
        events: list[Event] = []
        partition_of: dict[str, int] = {}
        offsets: dict[TopicPartition, OffsetAndMetadata] = {}
        for tp, recs in polled.items():
            for rec in recs:
                try:
                    ev = parse_event(rec.value)
                except (ValidationError, ValueError, TypeError):
                    # ingest validated everything on this topic; a bad record here is a bug
                    # upstream: count it and move on rather than block the partition.
                    m.REWARD_EVENTS.labels("invalid").inc()
                    log.warning("unparseable record on %s[%d]@%d skipped", tp.topic, tp.partition, rec.offset)
                    continue
                m.REWARD_EVENTS.labels(ev.type).inc()
                events.append(ev)
                partition_of[ev.request_id] = tp.partition
            if recs:
                offsets[tp] = OffsetAndMetadata(recs[-1].offset + 1, "", -1)
        return events, partition_of, offsets

    def _closable(self, due: list[tuple[int, str, float]], changed: dict[str, Window], now: float
                  ) -> tuple[list[_Outgoing], list[tuple[int, str]], list[tuple[int, str]]]:
        self._orphan_counts = {}
        if not due:
            return [], [], []
        # windows changed in this batch are in memory and were not emitted (their markers
        # were read with them); the others come from Redis with their emitted markers
        windows: dict[str, Window | None] = dict(changed)
        stored, emitted = self.state.load(rid for _, rid, _ in due if rid not in changed)
        windows.update(stored)
        out: list[_Outgoing] = []
        orphans: list[tuple[int, str]] = []
        stale: list[tuple[int, str]] = []
        for p, rid, t_close in due:
            w: Window | None = windows.get(rid)
            if w is None or rid in emitted:
                stale.append((p, rid))
                continue
            closed = close(w, self.spec, now)
            if closed.record is None:
                orphans.append((p, rid))
                self._orphan_counts[rid] = closed.orphan_events
                continue
            rec = closed.record
            out.append(_Outgoing(p, rid, rec.model_dump_json().encode(), t_close, rec.arm,
                                 rec.defaulted, rec.reward))
        return out, orphans, stale

    def _commit(self, out: list[_Outgoing], offsets: dict[TopicPartition, OffsetAndMetadata]) -> None:
        assert self.consumer is not None and self.producer is not None
        prod = self.producer
        prod.begin_transaction()
        self._futures = [
            (o.partition, prod.send(self.s.topics.rewards, value=o.value, key=o.request_id.encode(),
                                    partition=o.partition))
            for o in out
        ]
        if out:
            self._maybe_crash("mid_txn")
        check_sent(prod, (f for _, f in self._futures), TXN_TIMEOUT_S)
        if offsets:
            send_offsets(prod, offsets, self.consumer.group_metadata(), TXN_TIMEOUT_S)
        end_transaction(prod, True, TXN_TIMEOUT_S)
        if out:
            self._maybe_crash("after_commit")

    def reset_after_failure(self) -> None:
        """After a failed iteration (Kafka or Redis unreachable, a transaction that failed):
        abort the open transaction if any, replace the producer (never commit again under the
        producer id that failed), rewind to the committed offsets, and recover every owned
        partition from the rewards topic before applying anything (the failure may have come
        between the Kafka commit and the Redis mark). Raises when a dependency is still
        down; the caller retries with backoff."""
        assert self.consumer is not None
        if self.producer is not None:
            try:
                end_transaction(self.producer, False, 5.0)
            except Exception as exc:  # nothing open, or the producer is broken: it is replaced anyway
                log.info("abort before replacing the producer: %s", exc)
            close_quietly(self.producer)
            self.producer = None
        txid = self._open_producer()
        for tp in self.consumer.assignment():
            committed = self.consumer.committed(tp)
            if committed is None:
                self.consumer.seek_to_beginning(tp)
            else:
                self.consumer.seek(tp, committed)
        self.pending_recovery.update(self.owned())
        log.info("reward worker reconnected: transactional id %s, rewound to the committed offsets", txid)

    def _checkpoints(self, out: list[_Outgoing]) -> dict[int, int]:
        if not out:
            return {}
        ckpts: dict[int, int] = {}
        for p, fut in self._futures:
            off = fut.get(timeout=10).offset + 1
            ckpts[p] = max(ckpts.get(p, 0), off)
        return ckpts

    # ------------------------------------------------------------------ recovery
    def _recover(self, partitions: list[int]) -> int:
        """Mark every request already on the rewards topic as emitted (see module doc)."""
        rc, ru = self._committed_reader, self._uncommitted_reader
        assert rc is not None and ru is not None
        total = 0
        for p in partitions:
            tp = TopicPartition(self.s.topics.rewards, p)
            start = self.state.checkpoint(p)
            deadline = time.monotonic() + self.cfg.transaction_timeout_ms / 1000 + 10
            while True:
                lso = rc.end_offsets([tp])[tp]
                hw = ru.end_offsets([tp])[tp]
                if lso >= hw:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"rewards partition {p} keeps an open transaction (LSO {lso} < HW {hw})")
                self.health.beat()
                time.sleep(0.2)
            if start > lso:
                log.error("rewards partition %d ends at offset %d, below the checkpoint %d: the broker "
                          "lost reward records it had acknowledged (their requests stay marked emitted)",
                          p, lso, start)
            found: list[str] = []
            if start < lso:
                rc.assign([tp])
                rc.seek(tp, start)
                while rc.position(tp) < lso:
                    for recs in rc.poll(timeout_ms=500, max_records=5000).values():
                        found += [r.key.decode() for r in recs if r.key is not None]
                    self.health.beat()
            self.state.mark_recovered(p, found, lso)
            self.pending_recovery.discard(p)
            m.REWARD_RECOVERED.inc(len(found))
            total += len(found)
            log.info("partition %d: rewards topic read from %d to %d, %d request ids marked emitted",
                     p, start, lso, len(found))
        return total

    # ------------------------------------------------------------------ metrics
    def _gauges(self, now: float) -> None:
        if now - self._last_lag < 2.0:
            return
        self._last_lag = now
        owned = self.owned()
        count, overdue = self.state.open_stats(owned, now)
        m.REWARD_OPEN_WINDOWS.set(count)
        m.REWARD_OLDEST_OPEN_AGE.set(overdue)
        assert self.consumer is not None
        for p in owned:
            tp = TopicPartition(self.s.topics.events, p)
            hw = self.consumer.highwater(tp)
            if hw is None:
                continue
            try:
                pos = self.consumer.position(tp, timeout_ms=100)
            except KafkaError:
                continue
            if pos is not None:
                m.CONSUMER_LAG.labels(SERVICE, tp.topic, str(p)).set(max(0, hw - pos))

    def _maybe_crash(self, point: str) -> None:
        if self._crash and self._crash[0] == point and random.random() < self._crash[1]:
            log.error("test fault injection: SIGKILL at %s", point)
            os.kill(os.getpid(), signal.SIGKILL)


RETRIABLE = (KafkaError, redis.RedisError, OSError)
"""Errors of an unreachable or restarting broker or Redis: the worker retries, never exits."""


def run_loop(worker: RewardWorker, stopper: Stopper) -> None:
    """``run_once`` until stopped. A Kafka or Redis failure (broker or Redis restarting, a
    transaction that failed) does not end the process: the worker resets (new producer,
    rewind, recovery from the rewards topic) and retries with backoff (0.2 s doubling to 5 s)."""
    backoff = Backoff()
    failing = False
    down_since = 0.0
    while not stopper.stopping:
        try:
            if failing:
                worker.reset_after_failure()
            worker.run_once()
        except RETRIABLE as exc:
            dep = "redis" if isinstance(exc, redis.RedisError) else "kafka"
            worker._ok[dep] = False
            m.DEPENDENCY_RETRIES.labels(SERVICE, dep).inc()
            if not failing:
                down_since = time.monotonic()
            failing = True
            worker.health.beat()  # alive and retrying; readiness says what fails
            delay = backoff.next()
            log.warning("%s unavailable (%s: %s); retrying in %.1fs", dep, type(exc).__name__, exc, delay)
            stopper.wait(delay)
            continue
        if failing:
            log.info("dependencies answer again after %.1fs of failures", time.monotonic() - down_since)
            failing = False
            backoff.reset()


def _parse_crash(spec: str | None) -> tuple[str, float] | None:
    if not spec:
        return None
    point, _, prob = spec.partition(":")
    return point, float(prob or 1.0)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="rtrl serve reward", description=__doc__.split("\n\n")[0])
    ap.add_argument("--metrics-port", type=int, default=None, help="port for /metrics /healthz /readyz")
    ap.add_argument("--group-id", default=None, help="consumer group (default: settings)")
    ap.add_argument("--max-batch", type=int, default=None, help="most events per poll")
    ap.add_argument("--time-scale", type=float, default=None,
                    help="multiply the spec's window durations (e.g. 0.01 for demos)")
    ap.add_argument("--instance-id", default=None,
                    help="stable replica identity, e.g. the pod name: static group member and "
                         "transactional id base (default: settings)")
    ap.add_argument("--spec", default=None, help="reward spec TOML (default: settings, else packaged)")
    args = ap.parse_args(argv)
    stopper = Stopper().install()  # first: a SIGTERM during start-up is a clean stop too
    settings = get_settings()
    setup_logging(settings.log_level, SERVICE)
    upd: dict[str, Any] = {}
    if args.group_id:
        upd["group_id"] = args.group_id
    if args.max_batch:
        upd["max_batch"] = args.max_batch
    if args.time_scale is not None:
        upd["time_scale"] = args.time_scale
    if args.instance_id:
        upd["group_instance_id"] = args.instance_id
        upd["transactional_id"] = settings.reward.transactional_id or args.instance_id
    settings = settings.model_copy(update={"reward": settings.reward.model_copy(update=upd)})
    spec = load_spec(args.spec or settings.reward_spec)
    m.BUILD_INFO.info({"service": SERVICE, "reward_spec": spec.version})
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` prints every thread's stack
    health = Health()
    port = args.metrics_port if args.metrics_port is not None else settings.http.port
    http = HttpEndpoints(health, settings.http.host, port).start()
    worker = RewardWorker(settings, spec, health)
    try:
        worker.start()
        run_loop(worker, stopper)
        log.info("stopping: last batch committed")
    finally:
        worker.close()
        http.stop()
    return 0
