"""The librdkafka transport (confluent-kafka) of the exactly-once loop: its consumer here, its
transactional producer beside the other producers in services/runtime/transactions.py.

``RTRL_KAFKA__CLIENT=librdkafka`` gives the ingest and reward workers this consumer and
transactional producer instead of kafka-python's. The loop (services/runtime/exactly_once.py)
is written against the part of kafka-python's interface it uses; :class:`RdConsumer` and
``RdProducer`` implement that part on confluent-kafka's ``Consumer`` and ``Producer``:
records come back as :class:`Record` (kafka-python's field names), partitions as
kafka-python's ``TopicPartition``, and every librdkafka error is raised as a kafka-python
error class, so the loop's recovery (retriable ``KafkaError``, ``ProducerFencedError``) is
the same on both transports.

**Idle fetching.** librdkafka fetches in its own thread, whatever the application polls. A
broker that answers an empty fetch at once instead of holding it for ``fetch.wait.max.ms``
(the embedded broker does; Apache Kafka does not) turns that into about 6,000 fetches/s and
more than half a core per idle consumer. So once polls have found nothing for
``PAUSE_AFTER_S``, :class:`RdConsumer` pauses the partitions it has read to their end
(librdkafka's end-of-partition events say which) and remembers their high watermarks; each
later poll asks the broker for the watermarks (one ListOffsets request per paused partition)
and resumes only the partitions whose watermark moved. A resumed partition is
fetched within milliseconds: the ListOffsets request that follows the resume wakes
librdkafka's broker thread, which otherwise looks at resumed partitions once a second.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import confluent_kafka as ck
from kafka.errors import (
    KafkaError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    ProducerFencedError,
)
from kafka.structs import TopicPartition

from services.settings.model import KafkaSettings

log = logging.getLogger(__name__)

PAUSE_AFTER_S = 0.2
"""How long polls must find nothing before the consumer pauses its partitions."""
RESUME_WINDOW_S = 0.1
"""Longest a poll waits for records of partitions it has just resumed."""
CALL_TIMEOUT_S = 10.0
"""Deadline of librdkafka's blocking calls (transactions, offsets, metadata)."""
PROBE_TIMEOUT_S = 1.0
"""Deadline of one watermark request of a paused partition: a poll makes one per paused
partition and must stay well inside ``max.poll.interval.ms``."""

_FENCED = {ck.KafkaError._FENCED, ck.KafkaError.INVALID_PRODUCER_EPOCH,
           getattr(ck.KafkaError, "PRODUCER_FENCED", ck.KafkaError._FENCED)}
DISCONNECTS = {ck.KafkaError._TRANSPORT, ck.KafkaError._ALL_BROKERS_DOWN}

T = TypeVar("T")


class RdKafkaError(KafkaError):
    """A librdkafka error the loop recovers from (it replaces the producer and rewinds)."""

    retriable = True


def translate(exc: ck.KafkaException) -> Exception:
    """The kafka-python error the loop expects for a librdkafka exception."""
    err = exc.args[0] if exc.args and isinstance(exc.args[0], ck.KafkaError) else None
    if err is None:
        return RdKafkaError(str(exc))
    code = err.code()
    if code in _FENCED:
        return ProducerFencedError(err.str())
    if code == ck.KafkaError.MSG_SIZE_TOO_LARGE:
        return MessageSizeTooLargeError(err.str())
    if code == ck.KafkaError._TIMED_OUT:
        return KafkaTimeoutError(err.str())
    if code == ck.KafkaError._UNKNOWN_PARTITION:
        return ValueError(f"Unassigned partition: {err.str()}")  # as kafka-python's seek says
    return RdKafkaError(f"{err.name()}: {err.str()}")


def call(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` with librdkafka's exceptions raised as kafka-python's."""
    try:
        return fn(*args, **kwargs)
    except ck.KafkaException as exc:
        raise translate(exc) from exc


class FatalConsumerError(SystemExit):
    """librdkafka says the consumer cannot go on (e.g. another member took its static
    ``group.instance.id``): the process stops, as no retry can fix it."""


def fail(exc: ck.KafkaException) -> BaseException:
    """What a consumer raises for a librdkafka exception: :func:`translate`'s error, or
    :class:`FatalConsumerError` when librdkafka calls the error fatal."""
    err = exc.args[0] if exc.args and isinstance(exc.args[0], ck.KafkaError) else None
    if err is not None and err.fatal():
        return FatalConsumerError(f"the librdkafka consumer failed for good: {err.name()}: {err.str()}")
    return translate(exc)


def consumer_call(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """:func:`call` for consumer calls: a fatal error stops the process (:func:`fail`)."""
    try:
        return fn(*args, **kwargs)
    except ck.KafkaException as exc:
        raise fail(exc) from exc


def configured(cls: Callable[[dict[str, Any]], T], conf: dict[str, Any]) -> T:
    """A librdkafka client; a setting it refuses stops the process with librdkafka's reason
    (not a retriable error: retrying cannot fix a configuration)."""
    try:
        return cls(conf)
    except ck.KafkaException as exc:
        raise SystemExit(f"librdkafka refused the Kafka settings: {exc.args[0].str()}") from exc


def base_config(kafka: KafkaSettings) -> dict[str, Any]:
    """librdkafka's names for the connection settings kafka-python gets from
    ``KafkaSettings.client_kwargs`` (bootstrap servers, TLS, SASL, client id, timeouts)."""
    conf: dict[str, Any] = {
        "bootstrap.servers": ",".join(s.strip() for s in kafka.bootstrap_servers.split(",") if s.strip()),
        "security.protocol": kafka.security_protocol.lower(),
        "client.id": kafka.client_id,
        "socket.timeout.ms": kafka.request_timeout_ms,
    }
    if kafka.sasl_mechanism:
        conf["sasl.mechanism"] = kafka.sasl_mechanism
        conf["sasl.username"] = kafka.sasl_username or ""
        conf["sasl.password"] = kafka.sasl_password.get_secret_value() if kafka.sasl_password else ""
    for ours, theirs in (("ssl_cafile", "ssl.ca.location"), ("ssl_certfile", "ssl.certificate.location"),
                         ("ssl_keyfile", "ssl.key.location")):
        if getattr(kafka, ours):
            conf[theirs] = getattr(kafka, ours)
    return conf


@dataclass(frozen=True, slots=True)
class Record:
    """A consumed record with kafka-python's ``ConsumerRecord`` field names."""

    topic: str
    partition: int
    offset: int
    timestamp: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]] = field(default_factory=list)


def record(msg: Any) -> Record:
    return Record(msg.topic(), msg.partition(), msg.offset(), msg.timestamp()[1], msg.key(), msg.value(),
                  list(msg.headers() or []))


def to_ck(tp: TopicPartition, offset: int = ck.OFFSET_INVALID) -> ck.TopicPartition:
    return ck.TopicPartition(tp.topic, tp.partition, offset)


def _kp(tp: ck.TopicPartition) -> TopicPartition:
    return TopicPartition(tp.topic, tp.partition)


class RdConsumer:
    """A consumer-group member on librdkafka with the calls the exactly-once loop makes of
    kafka-python's ``KafkaConsumer``: never auto-commits, reads only committed data, and
    pauses its partitions while the topic is quiet (module doc)."""

    def __init__(self, kafka: KafkaSettings, group_id: str, *, max_poll_records: int = 500,
                 max_poll_interval_ms: int | None = None, group_instance_id: str | None = None,
                 fetch_max_wait_ms: int | None = None, client: Any = None, **_ignored: Any) -> None:
        conf = {
            **base_config(kafka),
            "group.id": group_id,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest",
            "isolation.level": "read_committed",
            "session.timeout.ms": 6000,
            "heartbeat.interval.ms": 1500,
            "enable.partition.eof": True,  # tells which partitions are read to their end
        }
        if max_poll_interval_ms:
            conf["max.poll.interval.ms"] = max_poll_interval_ms
        if group_instance_id:
            conf["group.instance.id"] = group_instance_id
        if fetch_max_wait_ms is not None:
            conf["fetch.wait.max.ms"] = fetch_max_wait_ms
        self._c = client if client is not None else configured(ck.Consumer, conf)
        """confluent-kafka's ``Consumer`` (``client``: one given, e.g. by a unit test)."""
        self.max_poll_records = max_poll_records
        self._paused: dict[TopicPartition, int] = {}
        """Partitions paused while quiet, with the end offset each was read to."""
        self._at_end: dict[TopicPartition, int] = {}
        """Partitions read to their end with no record since, and that end: the offset of
        librdkafka's end-of-partition event (the last stable offset under read_committed), or
        the watermark that last resumed the partition. Only these may be paused, and a paused
        one resumes when the broker's watermark differs from it: a record that arrived
        between the end-of-partition event and the pause moves the watermark past the mark."""
        self._empty_since: float | None = None
        self._callback_error: BaseException | None = None

    # ------------------------------------------------------------------ group
    def subscribe(self, topics: Sequence[str], listener: Any = None) -> None:
        # librdkafka keeps an application's pause across a rebalance: a partition paused
        # before it was revoked would come back paused, and nothing here would resume it
        def assigned(_c: Any, parts: list[ck.TopicPartition]) -> None:
            self._unpause(parts)
            self._notify(listener, "on_partitions_assigned", parts)

        def revoked(_c: Any, parts: list[ck.TopicPartition]) -> None:
            self._unpause(parts)
            self._notify(listener, "on_partitions_revoked", parts)

        consumer_call(self._c.subscribe, list(topics), on_assign=assigned, on_revoke=revoked, on_lost=revoked)

    def _unpause(self, parts: list[ck.TopicPartition]) -> None:
        """Resume these partitions and forget what was known of them (inside a rebalance)."""
        if parts:
            self._c.resume(parts)
        for p in parts:
            self._paused.pop(_kp(p), None)
            self._at_end.pop(_kp(p), None)

    def _notify(self, listener: Any, what: str, parts: list[ck.TopicPartition]) -> None:
        """Run a listener callback; an error in it is raised from the poll that ran it, after
        librdkafka has applied the assignment (an exception must not leave it half done)."""
        if listener is None:
            return
        try:
            getattr(listener, what)([_kp(p) for p in parts])
        except BaseException as exc:  # raised again from poll()
            self._callback_error = self._callback_error or exc

    def group_metadata(self) -> Any:
        return self._c.consumer_group_metadata()

    def assignment(self) -> set[TopicPartition]:
        return {_kp(p) for p in consumer_call(self._c.assignment)}

    # ------------------------------------------------------------------ records
    def poll(self, timeout_ms: int = 0, max_records: int | None = None) -> dict[TopicPartition, list[Record]]:
        """Records by partition: at most ``max_records``, waiting at most ``timeout_ms``."""
        n = max_records or self.max_poll_records
        if self._paused:
            msgs = self._resume_moved(n)
        else:
            msgs = consumer_call(self._c.consume, n, max(0.0, timeout_ms / 1000.0))
        self._raise_callback_error()
        out: dict[TopicPartition, list[Record]] = {}
        for msg in msgs:
            tp = TopicPartition(msg.topic(), msg.partition())
            err = msg.error()
            if err is not None:
                if err.code() == ck.KafkaError._PARTITION_EOF:
                    self._at_end[tp] = msg.offset()
                    continue
                raise fail(ck.KafkaException(err))
            self._at_end.pop(tp, None)
            out.setdefault(tp, []).append(record(msg))
        self._track_quiet(bool(out))
        return out

    def _raise_callback_error(self) -> None:
        if self._callback_error is not None:
            exc, self._callback_error = self._callback_error, None
            raise exc

    def _track_quiet(self, got: bool) -> None:
        now = time.monotonic()
        if got:
            self._empty_since = None
        elif self._empty_since is None:
            self._empty_since = now
        elif now - self._empty_since >= PAUSE_AFTER_S:
            self._pause_quiet()

    def _pause_quiet(self) -> None:
        """Pause the partitions read to their end that are not paused yet."""
        parts = sorted(tp for tp in self.assignment() if tp in self._at_end and tp not in self._paused)
        if parts:
            consumer_call(self._c.pause, [to_ck(tp) for tp in parts])
            self._paused.update({tp: self._at_end[tp] for tp in parts})

    def _high(self, tp: TopicPartition) -> int:
        """The partition's high watermark, asked of the broker now (-1 when it did not say)."""
        try:
            marks = consumer_call(self._c.get_watermark_offsets, to_ck(tp), timeout=PROBE_TIMEOUT_S,
                                  cached=False)
            return int(marks[1])
        except (KafkaError, ValueError) as exc:
            log.info("watermark of %s[%d] not read: %s", tp.topic, tp.partition, exc)
            return -1

    def _resume_moved(self, n: int) -> list[Any]:
        """Resume the paused partitions whose high watermark moved; their first records."""
        highs = {tp: self._high(tp) for tp in self._paused}
        moved = [tp for tp, mark in self._paused.items() if highs[tp] != mark]
        if not moved:
            # a poll all the same: it serves rebalances and tells librdkafka that the member
            # is alive (max.poll.interval.ms counts polls); paused partitions return nothing
            return list(consumer_call(self._c.consume, n, 0))
        self._resume(moved)
        for tp in moved:
            self._at_end[tp] = highs[tp]  # read up to here once resumed, unless a record says more
            self._high(tp)  # wakes the broker thread: the resumed partitions are fetched now
        deadline = time.monotonic() + RESUME_WINDOW_S
        msgs: list[Any] = []
        while not msgs and time.monotonic() < deadline:
            msgs = consumer_call(self._c.consume, n, 0.005)
        return msgs

    def _resume(self, parts: Iterable[TopicPartition]) -> None:
        parts = [tp for tp in parts if tp in self._paused]
        if parts:
            consumer_call(self._c.resume, [to_ck(tp) for tp in parts])
            for tp in parts:
                del self._paused[tp]
        self._empty_since = None

    # ------------------------------------------------------------------ offsets
    def committed(self, tp: TopicPartition, timeout_ms: int | None = None) -> int | None:
        timeout = (timeout_ms or CALL_TIMEOUT_S * 1000) / 1000.0
        got = consumer_call(self._c.committed, [to_ck(tp)], timeout=timeout)
        if got and got[0].error is not None:  # not "nothing committed": rewinding to 0 would replay
            raise fail(ck.KafkaException(got[0].error))
        return got[0].offset if got and got[0].offset >= 0 else None

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self._resume([tp])
        self._at_end.pop(tp, None)
        consumer_call(self._c.seek, to_ck(tp, offset))

    def seek_to_beginning(self, *tps: TopicPartition) -> None:
        for tp in tps:
            self.seek(tp, ck.OFFSET_BEGINNING)

    def position(self, tp: TopicPartition, timeout_ms: int | None = None) -> int | None:
        got = consumer_call(self._c.position, [to_ck(tp)])
        if got and got[0].offset >= 0:
            return int(got[0].offset)
        return self.committed(tp)  # nothing consumed yet: where consumption starts

    def end_offsets(self, tps: Iterable[TopicPartition],
                    timeout_ms: int | None = None) -> dict[TopicPartition, int]:
        timeout = (timeout_ms or CALL_TIMEOUT_S * 1000) / 1000.0
        marks = {tp: consumer_call(self._c.get_watermark_offsets, to_ck(tp), timeout=timeout, cached=False)
                 for tp in tps}
        return {tp: int(m[1]) for tp, m in marks.items()}

    def topics(self) -> set[str]:
        return set(consumer_call(self._c.list_topics, timeout=CALL_TIMEOUT_S).topics)

    def partitions_for_topic(self, topic: str) -> set[int] | None:
        meta = consumer_call(self._c.list_topics, topic, timeout=CALL_TIMEOUT_S).topics.get(topic)
        if meta is None or meta.error is not None:
            return None
        return set(meta.partitions)

    def close(self, autocommit: bool = False) -> None:
        """Leave the group; nothing is committed (offsets move only inside transactions)."""
        self._c.close()
