"""``rtrl serve ingest``: validate, authenticate and dedup raw events, exactly once.

One worker = one consumer in the ingest group on the raw topic and one transactional
producer. Each polled batch is handled as a unit:

1. every record goes through ``ingest.validate.validate`` (pure);
2. accepted events claim their ``event_id`` in the dedup store (one Redis round trip);
3. one Kafka transaction carries the valid events (to the events topic, keyed by
   ``request_id``), the rejected records (to the DLQ) and the batch's consumer offsets.

Outputs and offsets commit together or not at all: a worker killed anywhere in the batch
leaves an aborted (invisible to read_committed readers) transaction behind, and the next
owner of the partitions reads the batch again. The dedup markers make that replay safe
(ingest/dedup.py). SIGTERM finishes the current batch, commits it and exits 0.
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import os
import socket
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from kafka import ConsumerRebalanceListener, KafkaConsumer, KafkaProducer
from kafka.errors import KafkaError, ProducerFencedError
from kafka.structs import OffsetAndMetadata, TopicPartition

from ingest.adapters.redis_dedup import RedisDedupStore
from ingest.auth import AuthPolicy
from ingest.dedup import SOURCE_HEADER, DedupStore, is_duplicate, position_marker
from ingest.validate import Accepted, Limits, Rejected, validate
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
from services.runtime.redis_io import make_redis, wait_for_redis
from services.runtime.settings import Settings, get_settings

log = logging.getLogger("rtrl.ingest")

SERVICE = "ingest"
REASON_HEADER = "rtrl-reason"
DLQ_ORIGINAL_MAX = 512 * 1024
"""Most original bytes a DLQ record carries: base64 of more would not fit the producer's
1 MiB request limit, and a DLQ record that cannot be written would stall the partition."""
DLQ_KEY_MAX = 1024
"""Keys are not bounded by ``max_bytes``; DLQ records keep at most this much of one."""
TXN_TIMEOUT_S = 10.0
"""Longest wait for a batch's sends, offsets or commit before the transaction counts as failed."""


def auth_policy(settings: Settings) -> AuthPolicy:
    a = settings.auth
    return AuthPolicy(
        keys={k: v.get_secret_value().encode() for k, v in a.keys.items()},
        allow_unsigned=a.allow_unsigned,
        key_id_header=a.key_id_header,
        signature_header=a.signature_header,
    )


def limits(settings: Settings) -> Limits:
    s = settings.ingest
    return Limits(max_bytes=s.max_bytes, max_future_skew_s=s.max_future_skew_s, max_age_s=s.max_age_s)


def dlq_record(record: Any, rejected: Rejected, received_at: datetime) -> bytes:
    """The DLQ value for a rejected raw record (format documented in docs/ingest.md).

    Header *names* only are kept: a signature value must never be copied anywhere.
    """
    key = record.key[:DLQ_KEY_MAX] if record.key is not None else None
    value = record.value if record.value is not None else b""
    doc = {
        "reason": rejected.reason,
        "detail": rejected.detail,
        "source": {
            "topic": record.topic,
            "partition": record.partition,
            "offset": record.offset,
            "key": base64.b64encode(key).decode() if key is not None else None,
            "timestamp_ms": record.timestamp,
        },
        "headers": [name[:256] for name, _ in (record.headers or [])[:64]],
        "original_b64": base64.b64encode(value[:DLQ_ORIGINAL_MAX]).decode(),
        "original_size": len(value),
        "original_truncated": len(value) > DLQ_ORIGINAL_MAX,
        "received_at": received_at.isoformat().replace("+00:00", "Z"),
    }
    return json.dumps(doc, separators=(",", ":")).encode()


@dataclass
class BatchResult:
    """What one batch produced; metrics are counted only after its transaction commits."""

    valid: int = 0
    duplicate: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    offsets: dict[TopicPartition, int] = field(default_factory=dict)
    """Next offset to read per partition (what gets committed)."""
    first: dict[TopicPartition, int] = field(default_factory=dict)
    """First offset of the batch per partition (where to seek back after an abort)."""


class _Rebalance(ConsumerRebalanceListener):
    def __init__(self, worker: IngestWorker) -> None:
        self.worker = worker

    def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        self.worker.on_revoked(list(revoked))

    def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        self.worker.on_assigned(list(assigned))


class IngestWorker:
    """The batch loop of one ingest worker. ``run`` until the stopper is set."""

    def __init__(
        self,
        settings: Settings,
        consumer: KafkaConsumer,
        producer: KafkaProducer,
        dedup: DedupStore,
        health: Health,
        group_id: str,
        max_batch: int,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        new_producer: Callable[[], KafkaProducer] | None = None,
    ) -> None:
        self.settings = settings
        self.new_producer = new_producer
        """Opens a replacement transactional producer after a failed transaction (None: keep
        the producer, as in-memory tests do)."""
        self.consumer = consumer
        self.producer = producer
        self.dedup = dedup
        self.health = health
        self.group_id = group_id
        self.max_batch = max_batch
        self.clock = clock
        self.limits = limits(settings)
        self.auth = auth_policy(settings)
        self.in_transaction = False
        self.assignment_known = False
        self.assigned: list[TopicPartition] = []
        self.last_broker_ok = 0.0
        self._last_lag = 0.0
        health.add_check("broker", lambda: time.monotonic() - self.last_broker_ok < 30)
        health.add_check("assignment", lambda: self.assignment_known)

    # ------------------------------------------------------------------ rebalance
    def subscribe(self) -> None:
        self.consumer.subscribe([self.settings.topics.raw], listener=_Rebalance(self))

    def on_revoked(self, revoked: list[TopicPartition]) -> None:
        # Callbacks run inside poll(), between batches, so normally nothing is in flight.
        if self.in_transaction:
            log.warning("partitions revoked during a transaction: aborting it")
            self._abort()
        for tp in revoked:
            try:
                m.CONSUMER_LAG.remove(SERVICE, tp.topic, str(tp.partition))
            except KeyError:
                pass
        log.info("revoked %s", _fmt(revoked))

    def on_assigned(self, assigned: list[TopicPartition]) -> None:
        self.assigned = assigned
        self.assignment_known = True
        log.info("assigned %s", _fmt(assigned))

    # ------------------------------------------------------------------ the loop
    def run(self, stopper: Stopper) -> None:
        topics = self.settings.topics
        timeout_ms = self.settings.ingest.poll_timeout_ms
        backoff = Backoff()
        while not stopper.stopping:
            self.health.beat()
            try:
                polled = self.consumer.poll(timeout_ms=timeout_ms, max_records=self.max_batch)
            except KafkaError as exc:
                m.DEPENDENCY_RETRIES.labels(SERVICE, "kafka").inc()
                delay = backoff.next()
                log.warning("poll failed (%s: %s); retrying in %.1fs", type(exc).__name__, exc, delay)
                stopper.wait(delay)
                continue
            backoff.reset()
            if polled:
                self.last_broker_ok = time.monotonic()
                t0 = time.perf_counter()
                result = self.handle(polled, topics.events, topics.dlq, stopper)
                if result is not None:
                    m.BATCH_SECONDS.labels(SERVICE).observe(time.perf_counter() - t0)
                    _count(result)
            self._update_lag()

    def handle(
        self,
        polled: Mapping[TopicPartition, Sequence[Any]],
        events_topic: str,
        dlq_topic: str,
        stopper: Stopper | None = None,
    ) -> BatchResult | None:
        """Process one polled batch in one transaction; None when it was not committed
        (the consumer is rewound to the batch start and will read it again)."""
        now = self.clock()
        result = BatchResult()
        accepted: list[tuple[Any, Accepted]] = []
        rejected: list[tuple[Any, Rejected]] = []
        for tp, records in polled.items():
            result.first[tp] = records[0].offset
            result.offsets[tp] = records[-1].offset + 1
            for rec in records:
                out = validate(rec.value, rec.headers or [], rec.key, now, self.limits, self.auth)
                if isinstance(out, Accepted):
                    accepted.append((rec, out))
                else:
                    rejected.append((rec, out))

        claims = [(a.event.event_id, position_marker(r.topic, r.partition, r.offset)) for r, a in accepted]
        held = self._claim(claims, stopper)
        if held is None:
            self._rewind(result.first)
            return None

        futures = []
        try:
            self.producer.begin_transaction()
            self.in_transaction = True

            def send(topic: str, **kw: Any) -> None:
                futures.append(self.producer.send(topic, **kw))

            for (rec, acc), (event_id, marker), prev in zip(accepted, claims, held, strict=True):
                if is_duplicate(prev, marker):
                    result.duplicate += 1
                    if self.settings.ingest.dlq_duplicates:
                        why = f"event_id {event_id!r} first seen at {prev}"
                        rejected.append((rec, Rejected("duplicate", why)))
                    continue
                ev = acc.event
                send(
                    events_topic,
                    value=ev.model_dump_json().encode(),
                    key=ev.request_id.encode(),
                    headers=[(SOURCE_HEADER, marker.encode())],
                )
                result.valid += 1
            for rec, rej in rejected:
                send(
                    dlq_topic,
                    value=dlq_record(rec, rej, now),
                    key=rec.key[:DLQ_KEY_MAX] if rec.key is not None else None,
                    headers=[(REASON_HEADER, rej.reason.encode())],
                )
                result.rejected[rej.reason] += 1
            check_sent(self.producer, futures, TXN_TIMEOUT_S)
            send_offsets(
                self.producer,
                {tp: OffsetAndMetadata(off, "", -1) for tp, off in result.offsets.items()},
                self.consumer.group_metadata(),
                TXN_TIMEOUT_S,
            )
            end_transaction(self.producer, True, TXN_TIMEOUT_S)
            self.in_transaction = False
        except ProducerFencedError:
            self.in_transaction = False
            log.error("fenced: another ingest worker uses transactional id; stopping")
            raise
        except KafkaError as exc:
            m.DEPENDENCY_RETRIES.labels(SERVICE, "kafka").inc()
            log.warning("transaction failed (%s: %s): aborting, re-reading the batch",
                        type(exc).__name__, exc)
            self._recover_producer(stopper)
            self._rewind(result.first)
            return None
        self.last_broker_ok = time.monotonic()
        return result

    # ------------------------------------------------------------------ helpers
    def _claim(self, claims: list[tuple[str, str]], stopper: Stopper | None) -> list[str | None] | None:
        """Claim event ids, retrying while the store is down; per claim the marker that
        held the id before (None: first sighting). None if asked to stop meanwhile."""
        backoff = Backoff()
        while True:
            try:
                return self.dedup.claim_many(claims)
            except Exception as exc:  # the store's client errors; anything else would repeat too
                m.DEPENDENCY_RETRIES.labels(SERVICE, "redis").inc()
                delay = backoff.next()
                log.warning("dedup store failed (%s: %s); retrying in %.1fs", type(exc).__name__, exc, delay)
                if self._pause(stopper, delay):
                    return None

    def _abort(self) -> None:
        try:
            end_transaction(self.producer, False, 5.0)
        finally:
            self.in_transaction = False

    def _recover_producer(self, stopper: Stopper | None) -> None:
        """Abort the failed transaction and, when a factory is set, replace the producer: a
        transactional producer of kafka-python is not reliably usable after a broker restart,
        and a fresh transactional id never commits under a producer id that aborted. Retries
        with backoff while the broker (or Redis, for the id generation) is down."""
        try:
            self._abort()
        except Exception as exc:  # the producer may be broken; it is replaced below
            log.info("abort failed (%s: %s)", type(exc).__name__, exc)
        if self.new_producer is None:
            return
        close_quietly(self.producer)
        backoff = Backoff()
        while True:
            try:
                self.producer = self.new_producer()
                self.last_broker_ok = time.monotonic()
                log.info("ingest worker reconnected with a new transactional producer")
                return
            except ProducerFencedError:
                raise
            except Exception as exc:  # broker or Redis still down: try again
                m.DEPENDENCY_RETRIES.labels(SERVICE, "kafka").inc()
                delay = backoff.next()
                log.warning("cannot open a transactional producer yet (%s: %s); retrying in %.1fs",
                            type(exc).__name__, exc, delay)
                if self._pause(stopper, delay):
                    raise KafkaError("stopping while the broker is unreachable") from exc

    def _pause(self, stopper: Stopper | None, delay: float) -> bool:
        """Wait ``delay`` before a retry, alive for the health check; True if asked to stop."""
        self.health.beat()
        if stopper is None:
            time.sleep(delay)
            return False
        return stopper.wait(delay)

    def _rewind(self, first: Mapping[TopicPartition, int]) -> None:
        for tp, off in first.items():
            try:
                self.consumer.seek(tp, off)
            except Exception as exc:  # partition revoked meanwhile: its new owner re-reads it
                log.info("not rewinding %s (%s)", tp, exc)

    def _update_lag(self) -> None:
        """Every 2 s: lag per assigned partition from a real ListOffsets request, which also
        tells readiness that the broker answers."""
        now = time.monotonic()
        if now - self._last_lag < 2.0:
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
            log.info("broker did not answer the lag query: %s", exc)
            return
        self.last_broker_ok = time.monotonic()
        for tp in assigned:
            end, pos = ends.get(tp), positions.get(tp)
            if end is not None and pos is not None:
                m.CONSUMER_LAG.labels(SERVICE, tp.topic, str(tp.partition)).set(max(0, end - pos))


def _count(result: BatchResult) -> None:
    if result.valid:
        m.INGEST_EVENTS.labels("valid").inc(result.valid)
    if result.duplicate:
        m.INGEST_EVENTS.labels("duplicate").inc(result.duplicate)
    n_rejected = sum(n for reason, n in result.rejected.items() if reason != "duplicate")
    if n_rejected:
        m.INGEST_EVENTS.labels("rejected").inc(n_rejected)
    for reason, n in result.rejected.items():
        m.INGEST_REJECTED.labels(reason).inc(n)


def _fmt(tps: Sequence[TopicPartition]) -> str:
    return ", ".join(f"{tp.topic}[{tp.partition}]" for tp in sorted(tps)) or "nothing"


def transactional_id(group_id: str, instance_id: str | None, generation: int = 0) -> str:
    """Per replica generation when it has an instance id, else unique to this process."""
    if instance_id:
        return f"rtrl-ingest.{group_id}.{instance_id}.{generation}"
    return f"rtrl-ingest.{group_id}.{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class TransactionalIds:
    """Transactional ids of one replica across restarts: ``<group>.<instance>.<generation>``.

    Each start takes the next generation (a Redis counter) and first fences the previous
    generations' ids: ``init_transactions`` on an old id aborts whatever transaction a dead
    predecessor left open, at once rather than after the transaction timeout. The new
    generation then writes under a producer id of its own, so no reader can confuse its
    records with the aborted ones (some brokers, the embedded one among them, keep listing
    an aborted transaction of a producer id in later fetches).
    """

    KEEP = 10
    """At most this many unfenced generations are fenced at start-up."""

    def __init__(self, client: Any, key_prefix: str, group_id: str, instance_id: str) -> None:
        self._r = client
        self._gen_key = f"{key_prefix}ingest:txn-generation:{group_id}:{instance_id}"
        self._fenced_key = self._gen_key + ":fenced"
        self.group_id = group_id
        self.instance_id = instance_id

    def next(self) -> tuple[str, list[str]]:
        """The id to use now and the older ids still to fence, oldest first."""
        gen = int(self._r.incr(self._gen_key))
        fenced = int(self._r.get(self._fenced_key) or 0)
        stale = range(max(fenced + 1, gen - self.KEEP, 1), gen)
        return (transactional_id(self.group_id, self.instance_id, gen),
                [transactional_id(self.group_id, self.instance_id, g) for g in stale])

    def fenced(self, txn_id: str) -> None:
        """Record that every generation before ``txn_id``'s is fenced."""
        gen = int(txn_id.rsplit(".", 1)[1])
        self._r.set(self._fenced_key, gen - 1)


def fence(settings: Settings, txn_ids: Sequence[str]) -> None:
    """Abort any open transaction of these ids and fence their producers."""
    for txn_id in txn_ids:
        producer = make_producer(settings.kafka, transactional_id=txn_id,
                                 transaction_timeout_ms=settings.ingest.transaction_timeout_ms)
        try:
            producer.init_transactions()
            log.info("fenced %s", txn_id)
        finally:
            producer.close(timeout=10)


# ---------------------------------------------------------------------- entry point
def run_worker(
    settings: Settings,
    stopper: Stopper,
    group_id: str | None = None,
    max_batch: int | None = None,
    metrics_port: int | None = None,
    on_ready: Callable[[HttpEndpoints], None] | None = None,
) -> int:
    """Run one ingest worker until ``stopper`` is set; returns the exit code."""
    s = settings.ingest
    group = group_id or s.group_id
    batch = max_batch or s.max_batch
    health = Health()
    http = HttpEndpoints(health, settings.http.host,
                         settings.http.port if metrics_port is None else metrics_port).start()
    if on_ready is not None:
        on_ready(http)
    consumer: KafkaConsumer | None = None
    producer: KafkaProducer | None = None
    worker: IngestWorker | None = None
    try:
        try:
            wait_for_broker(settings.kafka, timeout_s=60)
            wait_for_redis(settings.redis.url.get_secret_value(), timeout_s=10)
        except TimeoutError as exc:
            log.error("cannot start: %s", exc)
            return 2
        ensure_topics(settings, [settings.topics.raw, settings.topics.events, settings.topics.dlq])
        redis_client = make_redis(settings.redis)
        ids = (TransactionalIds(redis_client, settings.redis.key_prefix, group, s.instance_id)
               if s.instance_id else None)
        txn_id = ""

        def new_producer() -> KafkaProducer:
            """A transactional producer under the next id (fencing the earlier generations)."""
            nonlocal txn_id
            if ids is not None:
                txn_id, stale = ids.next()
                fence(settings, stale)
                ids.fenced(txn_id)
            else:
                txn_id = transactional_id(group, None)
            prod = make_producer(
                settings.kafka, transactional_id=txn_id, transaction_timeout_ms=s.transaction_timeout_ms,
                batch_size=256 * 1024,  # a whole polled batch per partition in one produce request
            )
            try:
                prod.init_transactions()
            except BaseException:
                close_quietly(prod)
                raise
            return prod

        producer = new_producer()
        consumer = make_consumer(settings.kafka, group, max_poll_records=batch,
                                 max_poll_interval_ms=s.max_poll_interval_ms,
                                 group_instance_id=s.instance_id)
        dedup = RedisDedupStore(redis_client, settings.redis.key_prefix, s.dedup_ttl_s)
        worker = IngestWorker(settings, consumer, producer, dedup, health, group, batch,
                              new_producer=new_producer)
        worker.subscribe()
        log.info("ingest worker up: group %s, transactional id %s, %s -> %s / %s",
                 group, txn_id, settings.topics.raw, settings.topics.events, settings.topics.dlq)
        worker.run(stopper)
        log.info("stopped cleanly")
        return 0
    except ProducerFencedError:
        return 3
    finally:
        if consumer is not None:
            consumer.close(autocommit=False)
        if worker is not None:
            producer = worker.producer  # replaced after a failed transaction
        if producer is not None:
            producer.close(timeout=10)
        http.stop()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="rtrl serve ingest",
        description="Validate, authenticate and dedup raw events; forward them exactly once.")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="port for /metrics /healthz /readyz (default: RTRL_HTTP__PORT, 0 = free port)")
    parser.add_argument("--group-id", default=None, help="consumer group (default: RTRL_INGEST__GROUP_ID)")
    parser.add_argument("--max-batch", type=int, default=None,
                        help="records per poll and per transaction (default: RTRL_INGEST__MAX_BATCH)")
    parser.add_argument("--instance-id", default=None,
                        help="stable replica identity, e.g. the pod name (default: RTRL_INGEST__INSTANCE_ID)")
    args = parser.parse_args(argv)
    settings = get_settings()
    if args.instance_id:
        ingest = settings.ingest.model_copy(update={"instance_id": args.instance_id})
        settings = settings.model_copy(update={"ingest": ingest})
    setup_logging(settings.log_level, SERVICE)
    m.BUILD_INFO.info({"service": SERVICE})
    stopper = Stopper().install()

    def announce(http: HttpEndpoints) -> None:
        print(f"rtrl ingest: metrics on http://{settings.http.host}:{http.port}/metrics", flush=True)

    return run_worker(settings, stopper, args.group_id, args.max_batch, args.metrics_port, announce)
