"""Kafka adapters: producer, consumer and admin factories built from settings.

Only this module and the service entry points import kafka-python; domain code never does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import NewTopic
from kafka.errors import KafkaError, KafkaTimeoutError, TopicAlreadyExistsError

from services.runtime.rdkafka import RdConsumer
from services.settings.model import KafkaSettings, Settings, TopicSettings

log = logging.getLogger(__name__)


def make_producer(kafka: KafkaSettings, **overrides: Any) -> KafkaProducer:
    """A producer with safe defaults: acks=all, idempotent, keys and values as bytes, and
    records larger than ``kafka.max_message_bytes`` refused before they are sent
    (``MessageSizeTooLargeError`` from ``send``)."""
    kw: dict[str, Any] = {
        **kafka.client_kwargs(),
        "acks": "all",
        "enable_idempotence": True,
        "linger_ms": 5,
        "retries": 2**31 - 1,
        "max_request_size": kafka.max_message_bytes,
    }
    kw.update(overrides)
    return KafkaProducer(**kw)


def make_consumer(
    kafka: KafkaSettings, group_id: str | None, topics: Iterable[str] = (), **overrides: Any
) -> KafkaConsumer:
    """A consumer that never auto-commits and reads only committed transactional data."""
    kw: dict[str, Any] = {
        **kafka.client_kwargs(),
        "group_id": group_id,
        "enable_auto_commit": False,
        "auto_offset_reset": "earliest",
        "isolation_level": "read_committed",
        "max_poll_records": 500,
        "session_timeout_ms": 6000,
        "heartbeat_interval_ms": 1500,
    }
    kw.update(overrides)
    return KafkaConsumer(*topics, **kw)


def make_member(kafka: KafkaSettings, group_id: str, **overrides: Any) -> Any:
    """The consumer-group member of an exactly-once worker, on the client ``kafka.client``
    names: kafka-python's consumer (:func:`make_consumer`) or librdkafka's
    (services/runtime/rdkafka.py). Overrides use kafka-python's names."""
    if kafka.client == "librdkafka":
        return RdConsumer(kafka, group_id, **overrides)
    return make_consumer(kafka, group_id, **overrides)


def make_admin(kafka: KafkaSettings) -> KafkaAdminClient:
    return KafkaAdminClient(**kafka.client_kwargs())


def wait_for_broker(kafka: KafkaSettings, timeout_s: float = 30.0) -> None:
    """Block until the broker answers a metadata request; raise TimeoutError otherwise."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            admin = make_admin(kafka)
            try:
                admin.list_topics()
                return
            finally:
                admin.close()
        except (KafkaError, OSError, ValueError) as exc:
            last = exc
            time.sleep(0.2)
    raise TimeoutError(f"Kafka at {kafka.bootstrap_servers} did not answer in {timeout_s}s: {last}")


def topic_names(topics: TopicSettings) -> list[str]:
    return [topics.raw, topics.events, topics.rewards, topics.dlq]


def ensure_topics(settings: Settings, names: Iterable[str] | None = None) -> list[str]:
    """Create missing topics with the configured partitions and the record size limit
    (``max.message.bytes`` = ``kafka.max_message_bytes``); return the ones created. Topics
    that exist keep their configuration."""
    topics = settings.topics
    wanted = list(names) if names is not None else topic_names(topics)
    if not topics.create:
        return []
    admin = make_admin(settings.kafka)
    try:
        existing = set(admin.list_topics())
        missing = [n for n in wanted if n not in existing]
        if missing:
            try:
                admin.create_topics(
                    [NewTopic(n, topics.partitions, topics.replication_factor,
                              topic_configs={"max.message.bytes": str(settings.kafka.max_message_bytes)})
                     for n in missing]
                )
            except TopicAlreadyExistsError:
                pass
            log.info("created topics %s", missing)
        return missing
    finally:
        admin.close()


# ---------------------------------------------------------------------- transactions with a deadline
# kafka-python 3.0.12 waits for commit/abort/send_offsets without a deadline. After a broker
# restart its transaction manager can fail inside the producer's I/O thread (an
# OutOfOrderSequence on a batch that was in flight, then an invalid READY -> READY
# transition) and never complete the request: the caller would block for good. These
# helpers wait at most ``timeout_s`` and raise; the caller then replaces the producer.


def _await(producer: KafkaProducer, result: Any, what: str, timeout_s: float) -> None:
    producer._sender.wakeup()
    if not result.wait(timeout_ms=int(timeout_s * 1000)):
        raise KafkaTimeoutError(f"{what} did not complete in {timeout_s:.0f}s")


def end_transaction(producer: KafkaProducer, commit: bool, timeout_s: float) -> None:
    """``commit_transaction()`` (or ``abort_transaction()``) that gives up after ``timeout_s``."""
    tm = getattr(producer, "_transaction_manager", None)
    if tm is None:  # not kafka-python's producer (a test double): its own calls
        producer.commit_transaction() if commit else producer.abort_transaction()
        return
    if _abandoned(producer):
        raise KafkaTimeoutError("the producer was abandoned: it sends nothing more")
    result = tm.begin_commit() if commit else tm.begin_abort()
    _await(producer, result, "commit" if commit else "abort", timeout_s)


def send_offsets(producer: KafkaProducer, offsets: Any, group_metadata: Any, timeout_s: float) -> None:
    """``send_offsets_to_transaction`` that gives up after ``timeout_s``."""
    tm = getattr(producer, "_transaction_manager", None)
    if tm is None:
        producer.send_offsets_to_transaction(offsets, group_metadata)
        return
    result = tm.send_offsets_to_transaction(offsets, group_metadata)
    _await(producer, result, "send_offsets_to_transaction", timeout_s)


def check_sent(producer: KafkaProducer, futures: Iterable[Any], timeout_s: float,
               watch: ConnectionWatch | None = None) -> None:
    """Flush and raise the first send error. Commit only after this: after a broker restart
    kafka-python can complete a commit although some of the transaction's batches failed.

    With a ``watch``, a broker connection that closes while sends are pending abandons the
    producer at once (:func:`abandon`) and raises :class:`TransactionInterruptedError`:
    kafka-python would resend the failed batches once the broker is back, and the embedded
    broker, which aborted the transaction when it stopped, appends them as data of a
    transaction nobody will ever end. That data holds the partition's last stable offset
    for good (read_committed readers then see nothing after it)."""
    if watch is not None and watch.watching and hasattr(producer, "flush"):
        _flush_watched(producer, watch, timeout_s)
    elif hasattr(producer, "flush"):
        producer.flush(timeout=timeout_s)
    for fut in futures:
        if fut is None:  # a test double's send
            continue
        if not fut.is_done:
            raise KafkaTimeoutError(f"a send did not complete in {timeout_s:.0f}s")
        if fut.failed():
            raise fut.exception


def _flush_watched(producer: KafkaProducer, watch: ConnectionWatch, timeout_s: float) -> None:
    """Flush for at most ``timeout_s``, abandoning the producer as soon as a connection drops."""
    deadline = time.monotonic() + timeout_s
    while True:
        if watch.interrupted():
            abandon(producer)
            raise TransactionInterruptedError("a broker connection dropped while sends were pending")
        try:
            producer.flush(timeout=max(0.0, min(WATCH_POLL_S, deadline - time.monotonic())))
            return
        except KafkaTimeoutError:
            if time.monotonic() >= deadline:
                return  # the caller reports the send that did not complete


class TransactionInterruptedError(KafkaError):
    """A broker connection of the transactional producer closed while a transaction was open.

    A broker that restarts in the middle of a transaction may come back without the
    transaction's partitions, yet still accept its offsets and its commit: the client sees a
    commit, the input offsets move on, and the outputs are never visible to
    ``read_committed`` readers (the embedded broker does this; docs/reliability.md). So a
    transaction that lived through a reconnect is never trusted: it is aborted before its
    commit, or, when the connection dropped during the commit itself, the caller rewinds to
    the committed offsets."""

    retriable = True


class ConnectionWatch:
    """Which broker connections a producer held when a transaction began, and whether any of
    them closed or was replaced since (a reconnect). librdkafka's producer
    (services/runtime/rdkafka.py) tells instead how many connections it lost so far
    (``disconnects``). A producer that tells neither (a test double) is never reported as
    interrupted."""

    def __init__(self, producer: KafkaProducer) -> None:
        self._producer = producer
        held = _connections(producer)
        self._drops = getattr(producer, "disconnects", None)
        self.watching = held is not None or isinstance(self._drops, int)
        """Whether the producer exposes its connections (kafka-python 3.0 and librdkafka do)."""
        self._held = dict(held or {})

    def interrupted(self) -> bool:
        if isinstance(self._drops, int):
            return bool(getattr(self._producer, "disconnects", 0) != self._drops)
        now = _connections(self._producer)
        if now is None:
            return False
        return any(getattr(conn, "closed", False) or now.get(node) is not conn
                   for node, conn in self._held.items())


def _connections(producer: KafkaProducer) -> dict[Any, Any] | None:
    """kafka-python 3.0's open connections of a producer, node id -> connection (None when
    the producer does not have them: another client or a test double)."""
    manager = getattr(getattr(getattr(producer, "_sender", None), "_client", None), "_manager", None)
    conns = getattr(manager, "_conns", None)
    return conns if isinstance(conns, dict) else None


WATCH_POLL_S = 0.05
"""How often :func:`check_sent` looks at the producer's connections while sends are pending."""


def abandon(producer: KafkaProducer) -> None:
    """Stop a kafka-python producer's I/O thread without sending anything more (pending and
    retried batches fail at once). Its transaction is not ended by it: the broker aborted it
    when it stopped, or the next generation's fencing does (services/runtime/transactions.py)."""
    sender = getattr(producer, "_sender", None)
    if sender is not None and hasattr(sender, "force_close"):
        sender.force_close()


def _abandoned(producer: KafkaProducer) -> bool:
    sender = getattr(producer, "_sender", None)
    return bool(getattr(sender, "_force_close", False))


def close_quietly(producer: KafkaProducer | None) -> None:
    """Close a producer that may be broken, without waiting for its buffered records and
    without letting it resend any of them (a plain ``close(timeout=0)`` gives up in its flush
    and leaves the I/O thread retrying)."""
    if producer is None:
        return
    abandon(producer)
    try:
        producer.close(timeout=0)
    except Exception as exc:  # a broken producer may fail to close; it is dropped either way
        log.info("closing a broken producer: %s", exc)


class Backoff:
    """Delays between retries of an unreachable dependency: 0.2 s doubling up to ``cap``."""

    def __init__(self, first: float = 0.2, cap: float = 5.0) -> None:
        self.first, self.cap = first, cap
        self.delay = first

    def next(self) -> float:
        d = self.delay
        self.delay = min(self.delay * 2, self.cap)
        return d

    def reset(self) -> None:
        self.delay = self.first


def read_topic(kafka: KafkaSettings, topic: str, idle_timeout_s: float = 10.0) -> list[Any]:
    """Every record of ``topic`` (read_committed) from the beginning to the end offsets seen
    now, as kafka-python ``ConsumerRecord``s. Stops early when nothing arrives for
    ``idle_timeout_s`` (aborted data at the end). Never creates the topic: an audit or a report
    must not auto-create one with the broker's default of one partition."""
    c = make_consumer(kafka, None, fetch_max_bytes=16 * 1024 * 1024, allow_auto_create_topics=False)
    try:
        parts = c.partitions_for_topic(topic) or set()
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        if not tps:
            return []
        c.assign(tps)
        c.seek_to_beginning(*tps)
        ends = c.end_offsets(tps)
        out: list[Any] = []
        idle_since = time.monotonic()
        while any(c.position(tp) < ends[tp] for tp in tps):
            got = c.poll(timeout_ms=500, max_records=10_000)
            for tp, recs in got.items():
                out += [r for r in recs if r.offset < ends[tp]]
            if got:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since > idle_timeout_s:
                break
        return out
    finally:
        c.close(autocommit=False)
