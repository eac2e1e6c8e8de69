"""``rtrl serve reward``: join each request's events and emit exactly one reward record.

One worker = one member of the reward group on the events topic, run by the exactly-once
loop (services/runtime/exactly_once.py: one transaction per batch, fencing, failures).
Per polled batch of the events topic, :class:`RewardJoin`:

1. **Apply** the events to their windows in Redis (``ingest.reward.join``; idempotent by event_id,
   so a replayed batch changes nothing). Events of already-emitted requests are *late*:
   counted, never re-emitted.
2. **Close** the windows that are due (or closable early) on the partitions this worker
   owns, read from the per-partition due sets in Redis. Timers fire without new events:
   the loop wakes at the next close time, and polls at least every ``poll_timeout_ms``
   while a window is open (``idle_poll_ms`` while none is).
3. returns the reward records (for the rewards topic, same partition number as the
   events partition, key = request_id), which the loop commits in one Kafka transaction
   with the consumed offsets of the events topic;
4. once committed, **marks** those requests emitted in Redis, delete their windows and timers, and advance
   the partition's rewards-topic checkpoint (one atomic MULTI).

Crash anywhere and the restarted worker (or whichever worker gets the partition) repeats
from the last committed offsets: before the commit nothing was visible and the Redis
writes of 1 are replayed idempotently; between the commit and 4 the rewards are out but
Redis does not know, so on every partition assignment (and after any failure) the worker
first waits until the rewards partition has no
open transaction (last stable offset = high watermark), reads it (read_committed) from the
Redis checkpoint to its end, and marks every request id it finds as emitted. Only then
does it apply or close anything on that partition. Hence exactly one reward per request.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kafka import KafkaConsumer, TopicPartition
from pydantic import ValidationError

from ingest.adapters.committed_tail import CommittedTail
from ingest.adapters.redis_join import RedisJoinState
from ingest.adapters.redis_sessions import RedisSessionState
from ingest.contracts import prometheus as m
from ingest.contracts.keys import reward_txn_generation_key
from ingest.events import Event, parse_event
from ingest.reward.join import Window, apply_batch, close, close_at
from ingest.reward.spec import RewardSpec
from services.runtime.exactly_once import Batch, ExactlyOnceLoop, Output
from services.runtime.health import Health
from services.runtime.kafka_io import ensure_topics, make_consumer, make_member, wait_for_broker
from services.runtime.process import Stopper
from services.runtime.redis_io import make_redis
from services.runtime.transactions import TransactionalIds, TransactionalProducers, unique_transactional_id
from services.settings.model import Settings
from services.wiring.reward_sessions import SessionStage, forward, late_turn_notes, turn_notes

log = logging.getLogger("rtrl.reward")
SERVICE = "reward"
SESSIONS = "sessions_"
"""The session stage's prefix: its readiness checks, heartbeat and fault points."""

# Test-only fault injection: "<point>:<probability>", point in after_apply | mid_txn |
# before_commit | after_commit, or the session stage's sessions_mid_txn | sessions_before_commit |
# sessions_after_commit. The process SIGKILLs itself there, as an OOM kill or node loss would.
_CRASH_ENV = "RTRL_TEST_REWARD_CRASH"
GAUGES_EVERY_S = 2.0


@dataclass
class Closed:
    """One reward record closed in this batch."""

    partition: int
    request_id: str
    close_time: float
    arm: str
    defaulted: bool
    reward: float


@dataclass
class JoinResult:
    """What a batch closed, to be marked in Redis once its rewards are committed."""

    closed: list[Closed] = field(default_factory=list)
    orphans: list[tuple[int, str]] = field(default_factory=list)
    orphan_events: int = 0
    stale: list[tuple[int, str]] = field(default_factory=list)
    noted: list[tuple[int, str]] = field(default_factory=list)
    """Session turns handed to the session stage (marked emitted here: their record comes from there)."""


class RewardJoin:
    """The reward join as the exactly-once loop's transform (see the module doc)."""

    def __init__(self, settings: Settings, spec: RewardSpec, state: RedisJoinState, tail: CommittedTail,
                 fault: Callable[[str], None] = lambda _point: None) -> None:
        self.topics = settings.topics
        self.cfg = settings.reward
        self.spec = spec
        self.sessions = spec.session is not None
        """Session turns go to the session stage (services/wiring/reward_sessions.py)."""
        self.state = state
        self.tail = tail
        self.fault = fault
        self.pending_recovery: set[int] = set()
        self._last_gauges = 0.0

    def recover(self, partitions: Sequence[TopicPartition]) -> None:
        parts = sorted(tp.partition for tp in partitions if tp.topic == self.topics.events)
        self.pending_recovery.update(parts)
        if parts:
            log.info("partitions %s: recovering from the rewards topic first", parts)

    def transform(self, polled: Mapping[TopicPartition, Sequence[Any]],
                  assigned: Sequence[TopicPartition]) -> Batch[JoinResult]:
        owned = [tp.partition for tp in assigned if tp.topic == self.topics.events]
        self.pending_recovery &= set(owned)
        if self.pending_recovery:
            self._recover(sorted(self.pending_recovery))
        events, partition_of = _decode(polled)
        now = time.time()
        changed: dict[str, Window] = {}
        closes: dict[str, float] = {}
        forwarded = forward(events, self.topics.sessions) if self.sessions else []
        if events:
            windows, emitted = self.state.load(e.request_id for e in events)
            res = apply_batch(windows, emitted, events, now, self.spec)
            for ev in res.late:
                m.REWARD_LATE.labels(ev.type).inc()
            if self.sessions:
                forwarded += late_turn_notes(res.late, partition_of, self.topics.sessions)
            changed = res.windows
            closes = {rid: close_at(w, self.spec, self.cfg.time_scale) for rid, w in changed.items()}
        ready = [p for p in owned if p not in self.pending_recovery]
        due = self.state.save_and_due(changed, partition_of, closes, ready, now, self.cfg.max_close_per_batch)
        self.fault("after_apply")
        result, outputs = self._close_due(due.rows, changed, now)
        self._gauges(owned, now)
        return Batch(forwarded + outputs, result, wake_at=due.next_at)

    def committed(self, batch: Batch[JoinResult], delivered: Sequence[Any]) -> None:
        result = batch.result
        ckpts: dict[int, int] = {}
        for meta in delivered:
            if meta.topic == self.topics.rewards:  # not the forwarded session messages
                ckpts[meta.partition] = max(ckpts.get(meta.partition, 0), meta.offset + 1)
        self.state.finish([(c.partition, c.request_id) for c in result.closed] + result.noted,
                          result.orphans, result.stale, ckpts)
        done_t = time.time()
        for c in result.closed:
            m.REWARDS_EMITTED.labels(c.arm, str(c.defaulted).lower()).inc()
            m.observe_reward(c.arm, c.reward)
            m.REWARD_CLOSE_SECONDS.observe(max(0.0, done_t - c.close_time))
        if result.orphan_events:
            m.REWARD_ORPHANS.inc(result.orphan_events)

    def _close_due(self, due: list[tuple[int, str, float]], changed: dict[str, Window], now: float
                   ) -> tuple[JoinResult, list[Output]]:
        result, outputs = JoinResult(), list[Output]()
        if not due:
            return result, outputs
        # windows changed in this batch are in memory and were not emitted (their markers
        # were read with them); the others come from Redis with their emitted markers
        windows: dict[str, Window | None] = dict(changed)
        stored, emitted = self.state.load(rid for _, rid, _ in due if rid not in changed)
        windows.update(stored)
        for p, rid, t_close in due:
            w = windows.get(rid)
            if w is None or rid in emitted:
                result.stale.append((p, rid))
                continue
            closed = close(w, self.spec, now)
            if self.sessions and w.sessions:
                outputs += turn_notes(w, closed, p, self.spec, self.topics.sessions)
                result.noted.append((p, rid))
                continue
            if closed.record is None:
                result.orphans.append((p, rid))
                result.orphan_events += closed.orphan_events
                continue
            rec = closed.record
            result.closed.append(Closed(p, rid, t_close, rec.arm, rec.defaulted, rec.reward))
            outputs.append(Output(self.topics.rewards, rec.model_dump_json().encode(), rid.encode(),
                                  partition=p))
        return result, outputs

    def _recover(self, partitions: list[int]) -> None:
        """Mark every request already on the rewards topic as emitted (see the module doc)."""
        for p in partitions:
            tp = TopicPartition(self.topics.rewards, p)
            start = self.state.checkpoint(p)
            lso = self.tail.stable_end(tp)
            if start > lso:
                log.error("rewards partition %d ends at offset %d, below the checkpoint %d: the broker "
                          "lost reward records it had acknowledged (their requests stay marked emitted)",
                          p, lso, start)
            found = [r.key.decode() for r in self.tail.read(tp, start, lso) if r.key is not None] \
                if start < lso else []
            self.state.mark_recovered(p, found, lso)
            self.pending_recovery.discard(p)
            m.REWARD_RECOVERED.inc(len(found))
            log.info("partition %d: rewards topic read from %d to %d, %d request ids marked emitted",
                     p, start, lso, len(found))

    def _gauges(self, owned: list[int], now: float) -> None:
        if now - self._last_gauges < GAUGES_EVERY_S:
            return
        self._last_gauges = now
        count, overdue = self.state.open_stats(owned, now)
        m.REWARD_OPEN_WINDOWS.set(count)
        m.REWARD_OLDEST_OPEN_AGE.set(overdue)


def _decode(polled: Mapping[TopicPartition, Sequence[Any]]) -> tuple[list[Event], dict[str, int]]:
    events: list[Event] = []
    partition_of: dict[str, int] = {}
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
    return events, partition_of


class RewardWorker:
    """One reward worker process: the join, its Redis state and the exactly-once loop; under a
    spec with a ``[session]`` table, the session stage's loop beside it in a second thread."""

    def __init__(self, settings: Settings, spec: RewardSpec, health: Health | None = None) -> None:
        self.s = settings
        self.cfg = settings.reward
        self.spec = spec
        self.health = health or Health()
        client = make_redis(settings.redis)
        self.state = RedisJoinState(client, settings.redis.key_prefix, self.cfg.emitted_ttl_s)
        self.session_state = RedisSessionState(client, settings.redis.key_prefix, self.cfg.emitted_ttl_s)
        self.fault = crash_hook(os.environ.get(_CRASH_ENV))
        self.loops: list[ExactlyOnceLoop[Any]] = []
        """The join's loop, then the session stage's."""
        self._opened: list[KafkaConsumer | CommittedTail] = []
        """What to close if start() fails before a loop owns it."""

    def start(self) -> RewardWorker:
        s, cfg = self.s, self.cfg
        wait_for_broker(s.kafka)
        topics = [s.topics.events, s.topics.rewards] + ([s.topics.sessions] if self.spec.session else [])
        ensure_topics(s, topics)
        self.state.r.ping()
        join = RewardJoin(s, self.spec, self.state, self._tail(""), self.fault or (lambda _point: None))
        self._start_loop("", join, s.topics.events)
        if self.spec.session is not None:
            stage = SessionStage(s, self.spec, self.session_state, self._tail(SESSIONS))
            self._start_loop(SESSIONS, stage, s.topics.sessions)
        log.info("reward worker up: spec %s, group %s, time scale %g%s", self.spec.version, cfg.group_id,
                 cfg.time_scale, ", with the session stage" if self.spec.session else "")
        return self

    def _tail(self, prefix: str) -> CommittedTail:
        tail = CommittedTail(make_consumer(self.s.kafka, None),
                             make_consumer(self.s.kafka, None, isolation_level="read_uncommitted"),
                             functools.partial(self.health.beat, prefix), self.cfg.transaction_timeout_ms)
        self._opened.append(tail)
        return tail

    def _start_loop(self, prefix: str, transform: Any, topic: str) -> None:
        """One exactly-once loop on ``topic``. ``prefix`` ("" for the join, ``SESSIONS`` for the
        session stage) names its readiness checks, heartbeat and fault points, and suffixes its
        service name, group, static member id and transactional ids (``-sessions``)."""
        s, cfg = self.s, self.cfg
        suffix = f"-{prefix.rstrip('_')}" if prefix else ""
        service, group_id = SERVICE + suffix, cfg.group_id + suffix
        instance_id = cfg.group_instance_id + suffix if cfg.group_instance_id else None
        base = cfg.transactional_id or cfg.group_instance_id
        txn_base = base + suffix if base else None
        member: dict[str, Any] = {"group_instance_id": instance_id} if instance_id else {}
        # a short broker-side fetch wait keeps the loop (and its timers) turning under light load
        consumer = make_member(s.kafka, group_id, max_poll_records=cfg.max_batch, fetch_max_wait_ms=50,
                               max_poll_interval_ms=cfg.max_poll_interval_ms, **member)
        self._opened.append(consumer)
        _check_partitions(consumer, s)
        ids = transactional_ids(self.state.r, s.redis.key_prefix, txn_base) if txn_base else None
        fault = self.fault
        if fault is not None and prefix:  # the session stage's points: sessions_<point>
            fault = functools.partial(_prefixed, fault, prefix)
        producers = TransactionalProducers(
            s.kafka, cfg.transaction_timeout_ms, ids, lambda: unique_transactional_id(service, group_id),
            linger_ms=2, batch_size=256 * 1024, max_request_size=8 * 1024 * 1024)
        loop = ExactlyOnceLoop(service, consumer, producers.open, transform, self.health,
                               poll_timeout_ms=cfg.poll_timeout_ms, max_records=cfg.max_batch,
                               fault=fault, quiet_poll_ms=cfg.idle_poll_ms, check_prefix=prefix)
        self._opened.remove(consumer)
        self.loops.append(loop.start([topic]))
        log.info("%s loop: group %s, transactional id %s", service, group_id, producers.txn_id)

    def run(self, stopper: Stopper) -> None:
        """Run the loops until ``stopper`` is set; a loop that fails stops the other."""
        assert self.loops, "start() first"
        failures: list[BaseException] = []

        def side(loop: ExactlyOnceLoop[Any]) -> None:
            try:
                loop.run(stopper)
            except BaseException as exc:  # the process must not go on with half a worker
                failures.append(exc)
                stopper.stop()

        threads = [threading.Thread(target=side, args=(lp,), name=lp.service, daemon=True)
                   for lp in self.loops[1:]]
        for t in threads:
            t.start()
        try:
            self.loops[0].run(stopper)
        finally:
            stopper.stop()
            for t in threads:
                t.join()
        if failures:
            raise failures[0]

    def close(self) -> None:
        for loop in self.loops:
            loop.close()  # the group member (leaving without a commit) and the producer
        for opened in self._opened:
            if isinstance(opened, CommittedTail):
                opened.close()
            else:
                opened.close(autocommit=False)  # start() failed before a loop owned it


def transactional_ids(client: Any, key_prefix: str, base: str) -> TransactionalIds:
    """``<base>-<generation>``, the generation counted in Redis under ``reward:txgen:<base>``."""
    return TransactionalIds(client, reward_txn_generation_key(key_prefix, base), base, sep="-")


def _check_partitions(consumer: KafkaConsumer, s: Settings) -> None:
    ev = consumer.partitions_for_topic(s.topics.events) or set()
    rw = consumer.partitions_for_topic(s.topics.rewards) or set()
    if len(rw) < len(ev):
        raise SystemExit(
            f"topic {s.topics.rewards} has {len(rw)} partitions but {s.topics.events} "
            f"has {len(ev)}: the rewards topic needs at least as many (rewards of events "
            "partition p go to rewards partition p)")


def _prefixed(fault: Callable[[str], None], prefix: str, point: str) -> None:
    fault(prefix + point)


def crash_hook(spec: str | None) -> Callable[[str], None] | None:
    """The test-only fault hook of ``RTRL_TEST_REWARD_CRASH`` (None when unset)."""
    if not spec:
        return None
    point, _, prob = spec.partition(":")
    probability = float(prob or 1.0)

    def crash(at: str) -> None:
        if at == point and random.random() < probability:
            log.error("test fault injection: SIGKILL at %s", at)
            os.kill(os.getpid(), signal.SIGKILL)

    return crash
