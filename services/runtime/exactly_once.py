"""One exactly-once consume-transform-produce loop: what ingest and reward workers share.

A worker is a member of one consumer group on its input topic with one transactional
producer. The loop owns the Kafka side; the worker supplies a :class:`Transform` that turns
a polled batch into output records. One iteration:

1. **poll** at most ``max_records`` records from the partitions this member owns, without
   blocking in the client; after an empty poll the loop waits 10 ms, doubling up to
   ``poll_timeout_ms`` (``quiet_poll_ms`` while the transform has no timer pending), and
   never past the transform's next timer (``Batch.wake_at``) (ingest/adapters/idle_poll.py:
   a quiet topic costs a few polls per second, whether or not the broker holds empty fetches);
2. **transform** them (``Transform.transform``): validate, join, decide. The transform may
   read and write its own state store (Redis), but only idempotently: the same batch may
   be transformed again after a failure;
3. **commit** one Kafka transaction carrying the output records *and* the batch's next
   offsets (``send_offsets_to_transaction`` with the consumer's group metadata, so a member
   that was fenced or lost its partitions cannot commit). Outputs and input offsets become
   visible to ``read_committed`` readers together or not at all;
4. **committed** (``Transform.committed``): what must follow the commit (metrics, marking
   state as done), given where each output landed.

Recovery protocol:

- *Crash before the commit* (kill -9, OOM, node loss): the open transaction is aborted
  (by the next generation's fencing, below, or by the broker's transaction timeout) and is
  invisible to readers; the partitions' next owner reads the batch again from the
  committed offsets. Step 2 being idempotent makes the replay safe.
- *Crash between the commit and step 4*: the outputs are out, the state store does not
  know. Every time partitions are assigned (and after any failure) the loop calls
  ``Transform.recover(partitions)`` before the next transform: the transform brings its
  store up to what the output topics say (the reward join reads its rewards partitions
  back; ingest's dedup markers need nothing).
- *A dependency fails* (broker or Redis unreachable or restarting, a transaction that did
  not complete): the process does not exit. The loop aborts the open transaction, replaces
  the producer when Kafka was involved (a kafka-python transactional producer is not
  reliably usable after a broker restart, and a new transactional id never commits under a
  producer id that aborted), rewinds the consumer to its committed offsets, calls
  ``recover`` on every owned partition and retries with backoff (0.2 s doubling to 5 s).
- *A reconnect during a transaction*: a broker that restarted mid-transaction may have
  forgotten the transaction's partitions yet accept its offsets and commit, so the outputs
  would never become visible while the input moved on. A transaction during which any of the
  producer's broker connections closed is therefore aborted instead of committed, and one
  whose commit itself spanned a reconnect is followed by the rewind above (the
  ``recover`` step reconciles whichever way the commit went).
- *A rebalance*: the loop owns exactly the partitions of the last ``on_partitions_assigned``
  not revoked since, and hands only those to the transform. kafka-python keeps revoked
  partitions in ``assignment()`` until the rejoin completes, and a non-blocking poll returns
  during the rejoin; a transform that closed timers on them would commit outputs for
  partitions another member already recovered (a broker that checks the group generation in
  ``TxnOffsetCommit`` rejects such a commit; the embedded one does not). The rewind after a
  failure skips a partition revoked while its committed offset was fetched (kafka-python
  refuses to seek it with a ``ValueError``, which stopped the worker).
- *FencedError* (``ProducerFencedError``): another process opened our transactional id, i.e. a
  second replica runs with the same identity. The loop raises :class:`FencedError`; the
  process exits 3 rather than fight it.

Transactional ids and how each new producer fences its predecessors: services/runtime/transactions.py.
SIGTERM: ``run`` finishes the current iteration, its commit included, and returns.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import redis
from kafka import ConsumerRebalanceListener, KafkaConsumer, KafkaProducer
from kafka.errors import KafkaError, ProducerFencedError
from kafka.structs import OffsetAndMetadata, TopicPartition

from ingest.adapters.idle_poll import IdlePoller
from ingest.contracts import prometheus as m
from services.runtime.health import Health
from services.runtime.kafka_io import (
    Backoff,
    ConnectionWatch,
    TransactionInterruptedError,
    check_sent,
    close_quietly,
    end_transaction,
    send_offsets,
)
from services.runtime.process import Stopper

TXN_TIMEOUT_S = 10.0
"""Longest wait for a batch's sends, offsets or commit before the transaction counts as failed."""
LAG_EVERY_S = 2.0  # how often the lag gauges are refreshed (one ListOffsets request)
BROKER_STALE_S = 30.0
"""Readiness fails when the broker has not answered for this long."""

RETRIABLE = (KafkaError, redis.RedisError, OSError)
"""Errors of an unreachable or restarting broker or Redis: the loop recovers and retries."""

R = TypeVar("R")


@dataclass(frozen=True)
class Output:
    """One record to produce inside the batch's transaction."""

    topic: str
    value: bytes
    key: bytes | None = None
    headers: tuple[tuple[str, bytes], ...] = ()
    partition: int | None = None
    """None: the producer's partitioner picks it from the key."""


@dataclass
class Batch(Generic[R]):
    """What a transform made of one polled batch: the records to produce, and whatever it
    needs to finish the batch once they are committed."""

    outputs: list[Output]
    result: R
    wake_at: float | None = None
    """When (``time.time()``) the transform next needs a step though no record comes (its
    next timer); None: nothing pending (the loop may poll less often)."""


class Transform(Protocol[R]):
    """The worker-specific part of the loop. Methods are called from the loop's thread only."""

    def transform(self, polled: Mapping[TopicPartition, Sequence[Any]],
                  assigned: Sequence[TopicPartition]) -> Batch[R]:
        """Turn a polled batch (possibly empty: timers may still produce) into outputs.
        Called again with the same records after a failure, so its state writes must be
        idempotent. Raising a retriable error makes the loop recover and retry."""
        ...

    def committed(self, batch: Batch[R], delivered: Sequence[Any]) -> None:
        """The batch's transaction committed (or the batch had nothing to commit);
        ``delivered`` holds each output's record metadata (topic, partition, offset), in
        order. A failure here is recovered by ``recover``."""
        ...

    def recover(self, partitions: Sequence[TopicPartition]) -> None:
        """These input partitions were (re)assigned, or the loop failed while owning them:
        bring the transform's state up to what the committed outputs say before the next
        ``transform`` touches them."""
        ...


class FencedError(RuntimeError):
    """Another producer took over this worker's transactional id: the process must stop."""


class _Rebalance(ConsumerRebalanceListener):
    def __init__(self, loop: ExactlyOnceLoop[Any]) -> None:
        self.loop = loop

    def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        self.loop.on_revoked(list(revoked))

    def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        self.loop.on_assigned(list(assigned))


class ExactlyOnceLoop(Generic[R]):
    """Poll, transform, commit in one transaction; recover from failures (module doc).

    ``open_producer`` opens a new initialised transactional producer; it is called once at
    start and again after every failure that involved Kafka. ``fault`` is a test hook
    called at ``mid_txn``, ``before_commit`` and ``after_commit`` of batches with outputs.
    """

    def __init__(
        self,
        service: str,
        consumer: KafkaConsumer,
        open_producer: Callable[[], KafkaProducer],
        transform: Transform[R],
        health: Health,
        *,
        poll_timeout_ms: int,
        max_records: int,
        fault: Callable[[str], None] | None = None,
        quiet_poll_ms: int | None = None, check_prefix: str = "",
    ) -> None:
        self.service = service
        self.log = logging.getLogger(f"rtrl.{service}")
        self.consumer = consumer
        self.open_producer = open_producer
        self.transform = transform
        self.health = health
        self.poller = IdlePoller(consumer, idle_ms=poll_timeout_ms, quiet_ms=quiet_poll_ms)
        """Waits between polls of a quiet topic (module doc; ``run`` makes them the
        stopper's, so a SIGTERM does not wait for one)."""
        self.max_records = max_records
        self.fault = fault or (lambda _point: None)
        self.producer: KafkaProducer | None = None
        self.in_transaction = False
        self.assignment_known = False
        self.owned: set[TopicPartition] = set()
        """The partitions this member owns: assigned by the last rebalance and not revoked
        since (``consumer.assignment()`` still lists revoked ones until the rejoin completes)."""
        self.last_broker_ok = 0.0
        self.failing: str | None = None
        """The dependency whose failure the loop is recovering from (None: healthy)."""
        self._replace_producer = False
        self._last_lag = 0.0
        self.check_prefix = pre = check_prefix  # names its checks and heartbeat beside other loops
        health.add_check(f"{pre}broker", lambda: time.monotonic() - self.last_broker_ok < BROKER_STALE_S)
        health.add_check(f"{pre}redis", lambda: self.failing != "redis")
        health.add_check(f"{pre}assignment", lambda: self.assignment_known)

    # ------------------------------------------------------------------ lifecycle
    def start(self, topics: Sequence[str]) -> ExactlyOnceLoop[R]:
        """Open the first producer and subscribe (partitions arrive with the first poll)."""
        self.producer = self.open_producer()
        self.last_broker_ok = time.monotonic()
        self.consumer.subscribe(list(topics), listener=_Rebalance(self))
        return self

    def close(self) -> None:
        """Leave the group without committing anything and close the producer."""
        self.consumer.close(autocommit=False)
        if self.producer is not None:
            self.producer.close(timeout=10)

    def run(self, stopper: Stopper) -> None:
        """Iterate until ``stopper`` is set; raises :class:`FencedError` if another process took
        over the transactional id."""
        backoff = Backoff()
        down_since = 0.0
        self.poller.wait = stopper.wait
        while not stopper.stopping:
            self.health.beat(self.check_prefix)
            try:
                if self.failing is not None:
                    self._reset()
                self.step()
            except ProducerFencedError as exc:
                raise FencedError(f"{self.service}: another producer uses our transactional id") from exc
            except RETRIABLE as exc:
                dep = "redis" if isinstance(exc, redis.RedisError) else "kafka"
                if self.failing is None:
                    down_since = time.monotonic()
                self._failed(dep)
                delay = backoff.next()
                self.log.warning("%s unavailable (%s: %s); retrying in %.1fs",
                                 dep, type(exc).__name__, exc, delay)
                stopper.wait(delay)
                continue
            if self.failing is not None:
                self.log.info("dependencies answer again after %.1fs of failures",
                              time.monotonic() - down_since)
                self.failing = None
                backoff.reset()

    # ------------------------------------------------------------------ one iteration
    def step(self) -> Batch[R] | None:
        """One poll -> transform -> transaction -> committed. Returns the committed batch
        (None when there was nothing to commit); raises on any failure."""
        polled = self.poller.poll(max_records=self.max_records)
        self.last_broker_ok = time.monotonic()
        t0 = time.perf_counter()
        polled = {tp: recs for tp, recs in polled.items() if tp in self.owned}
        batch = self.transform.transform(polled, sorted(self.owned))
        self.poller.wake_at(batch.wake_at)
        offsets = next_offsets(polled)
        if not (batch.outputs or offsets):
            self.transform.committed(batch, [])  # nothing to commit: the batch is done as it is
            self._update_lag()
            return None
        delivered = self._commit(batch.outputs, offsets)
        self.transform.committed(batch, delivered)
        m.BATCH_SECONDS.labels(self.service).observe(time.perf_counter() - t0)
        self._update_lag()
        return batch

    def _commit(self, outputs: Sequence[Output], offsets: Mapping[TopicPartition, int]) -> list[Any]:
        """One transaction: the outputs and the input offsets; each output's metadata back."""
        prod = self.producer
        assert prod is not None, "start() opens the producer"
        prod.begin_transaction()
        self.in_transaction = True
        watch = ConnectionWatch(prod)
        futures = [prod.send(o.topic, value=o.value, key=o.key, headers=list(o.headers) or None,
                             partition=o.partition) for o in outputs]
        if outputs:
            self.fault("mid_txn")
        check_sent(prod, futures, TXN_TIMEOUT_S, watch)
        if offsets:
            committed = {tp: OffsetAndMetadata(off, "", -1) for tp, off in offsets.items()}
            send_offsets(prod, committed, self.consumer.group_metadata(), TXN_TIMEOUT_S)
        if outputs:
            self.fault("before_commit")
        if watch.interrupted():
            raise TransactionInterruptedError("the broker connection dropped during the transaction")
        end_transaction(prod, True, TXN_TIMEOUT_S)
        self.in_transaction = False
        if watch.interrupted():
            raise TransactionInterruptedError("the broker connection dropped during the commit: "
                                         "rewinding to the committed offsets")
        self.last_broker_ok = time.monotonic()
        if outputs:
            self.fault("after_commit")
        return [f.get(timeout=TXN_TIMEOUT_S) if f is not None else None for f in futures]

    # ------------------------------------------------------------------ failures
    def _failed(self, dependency: str) -> None:
        m.DEPENDENCY_RETRIES.labels(self.service, dependency).inc()
        # a transaction that was open, or any Kafka failure, retires the producer
        self._replace_producer = self._replace_producer or dependency == "kafka" or self.in_transaction
        self.failing = dependency
        self.health.beat(self.check_prefix)  # alive and retrying; readiness says what fails

    def _reset(self) -> None:
        """After a failure: abort, replace the producer if needed, rewind to the committed
        offsets and recover every owned partition. Raises while a dependency is still down."""
        self.poller.busy()
        if self._replace_producer:
            self._abort()
            close_quietly(self.producer)
            self.producer = None
            self.producer = self.open_producer()
            self._replace_producer = False
            self.log.info("%s worker reconnected with a new transactional producer", self.service)
        elif self.in_transaction:
            self._abort()
        for tp in sorted(self.owned):
            committed = self.consumer.committed(tp, timeout_ms=10_000)  # unbounded, SIGTERM went unseen
            try:
                if committed is None:
                    self.consumer.seek_to_beginning(tp)
                else:
                    self.consumer.seek(tp, committed)
            except ValueError:
                # kafka-python's "Unassigned partition": revoked meanwhile; whoever owns it
                # next starts from the committed offset anyway
                self.log.info("%s was revoked during the rewind", _fmt([tp]))
        self.transform.recover(sorted(self.owned))

    def _abort(self) -> None:
        try:
            if self.producer is not None:
                end_transaction(self.producer, False, 5.0)
        except Exception as exc:  # nothing open, or the producer is broken: it is replaced anyway
            self.log.info("abort failed (%s: %s)", type(exc).__name__, exc)
        finally:
            self.in_transaction = False

    # ------------------------------------------------------------------ rebalance
    def on_revoked(self, revoked: list[TopicPartition]) -> None:
        # callbacks run inside poll(), between batches, so normally nothing is in flight
        if self.in_transaction:
            self.log.warning("partitions revoked during a transaction: aborting it")
            self._abort()
        self.owned -= set(revoked)
        for tp in revoked:
            try:
                m.CONSUMER_LAG.remove(self.service, tp.topic, str(tp.partition))
            except KeyError:
                pass
        self.log.info("revoked %s", _fmt(revoked))

    def on_assigned(self, assigned: list[TopicPartition]) -> None:
        self.assignment_known = True
        self.owned |= set(assigned)  # eager: after revoking all; cooperative: what was added
        self.log.info("assigned %s", _fmt(assigned))
        self.transform.recover(sorted(assigned))

    # ------------------------------------------------------------------ lag
    def _update_lag(self) -> None:
        """Every ``LAG_EVERY_S``: lag per owned partition from a real ListOffsets request,
        which also tells readiness that the broker answers."""
        now = time.monotonic()
        if now - self._last_lag < LAG_EVERY_S:
            return
        self._last_lag = now
        assigned = list(self.consumer.assignment())
        try:
            if not assigned:
                self.consumer.topics()  # a metadata request: is the broker there?
                self.last_broker_ok = time.monotonic()
                return
            ends = self.consumer.end_offsets(assigned, timeout_ms=2000)
            positions = {tp: self.consumer.position(tp, timeout_ms=1000) for tp in assigned}
        except Exception as exc:  # lag is best effort; never stop the loop for it
            self.log.info("broker did not answer the lag query: %s", exc)
            m.DEPENDENCY_RETRIES.labels(self.service, "kafka").inc()  # polls do not raise
            return
        self.last_broker_ok = time.monotonic()
        for tp in assigned:
            end, pos = ends.get(tp), positions.get(tp)
            if end is not None and pos is not None:
                m.CONSUMER_LAG.labels(self.service, tp.topic, str(tp.partition)).set(max(0, end - pos))


def next_offsets(polled: Mapping[TopicPartition, Sequence[Any]]) -> dict[TopicPartition, int]:
    """The offset to commit per polled partition: one past its last record."""
    return {tp: records[-1].offset + 1 for tp, records in polled.items() if records}


def _fmt(tps: Sequence[TopicPartition]) -> str:
    return ", ".join(f"{tp.topic}[{tp.partition}]" for tp in sorted(tps)) or "nothing"
