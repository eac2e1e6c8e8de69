"""Transactional ids and producers of the exactly-once workers (services/runtime/exactly_once.py).

A replica with a stable identity (e.g. the pod name) takes the next *generation* of its
transactional id on every producer it opens (a Redis counter) and first fences the
generations before it that are not fenced yet: ``init_transactions`` under an old id
aborts whatever transaction a dead predecessor left open at once, rather than after the
transaction timeout. A fresh id also means a fresh producer id, so an aborted transaction
is never followed by committed data of the same producer id (some Kafka-protocol brokers,
the embedded one among them, keep listing an aborted transaction of a producer id in later
fetch responses, which makes ``read_committed`` readers skip data after it). Without a
stable identity each producer gets a unique id.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import confluent_kafka as ck
from kafka import KafkaProducer
from kafka.errors import KafkaTimeoutError
from kafka.structs import TopicPartition

from ingest.contracts.keys import fenced_key
from ingest.contracts.transactions import generation_id, generation_of, process_id
from services.runtime.kafka_io import close_quietly, make_producer
from services.runtime.rdkafka import (
    CALL_TIMEOUT_S,
    DISCONNECTS,
    base_config,
    call,
    configured,
    to_ck,
    translate,
)
from services.settings.model import KafkaSettings

log = logging.getLogger("rtrl.exactly_once")


def make_transactional_producer(kafka: KafkaSettings, transactional_id: str, **overrides: Any) -> Any:
    """A transactional producer (not yet initialised) on the client ``kafka.client`` names:
    kafka-python's, or librdkafka's (:class:`RdProducer`). Overrides use kafka-python's names."""
    if kafka.client == "librdkafka":
        return RdProducer(kafka, transactional_id=transactional_id, **overrides)
    return make_producer(kafka, transactional_id=transactional_id, **overrides)


def unique_transactional_id(service: str, group_id: str) -> str:
    """An id unique to this process (no stable replica identity)."""
    return process_id(service, group_id, socket.gethostname(), os.getpid(), uuid.uuid4().hex[:8])


class TransactionalIds:
    """Transactional ids of one replica across restarts: ``<prefix><sep><generation>``.

    ``next`` takes the next generation (a Redis counter under ``key``) and returns it with
    the older generations still to fence; ``fenced`` records that they are. At most
    ``KEEP`` generations are fenced at once (older ones timed out long ago).
    """

    KEEP = 10

    def __init__(self, client: Any, key: str, prefix: str, sep: str = ".") -> None:
        self._r = client
        self._gen_key = key
        self._fenced_key = fenced_key(key)
        self.prefix = prefix
        self.sep = sep

    def name(self, generation: int) -> str:
        return generation_id(self.prefix, self.sep, generation)

    def next(self) -> tuple[str, list[str]]:
        """The id to use now and the older ids still to fence, oldest first."""
        gen = int(self._r.incr(self._gen_key))
        fenced = int(self._r.get(self._fenced_key) or 0)
        stale = range(max(fenced + 1, gen - self.KEEP, 1), gen)
        return self.name(gen), [self.name(g) for g in stale]

    def fenced(self, txn_id: str) -> None:
        """Record that every generation before ``txn_id``'s is fenced."""
        gen = generation_of(txn_id, self.sep)
        self._r.set(self._fenced_key, gen - 1)


class TransactionalProducers:
    """Opens the worker's transactional producers: each under a fresh id, after fencing the
    ids of earlier generations (see the module doc)."""

    def __init__(self, kafka: KafkaSettings, transaction_timeout_ms: int, ids: TransactionalIds | None,
                 fallback_id: Callable[[], str], **producer_overrides: Any) -> None:
        self.kafka = kafka
        self.transaction_timeout_ms = transaction_timeout_ms
        self.ids = ids
        self.fallback_id = fallback_id
        self.overrides = producer_overrides
        self.txn_id = ""

    def _producer(self, txn_id: str) -> KafkaProducer:
        kw = {"transaction_timeout_ms": self.transaction_timeout_ms, **self.overrides}
        return make_transactional_producer(self.kafka, txn_id, **kw)

    def fence(self, txn_ids: Iterable[str]) -> None:
        """Abort any open transaction of these ids and fence their producers."""
        for txn_id in txn_ids:
            producer = self._producer(txn_id)
            try:
                producer.init_transactions()
                log.info("fenced %s", txn_id)
            finally:
                producer.close(timeout=10)

    def open(self) -> KafkaProducer:
        """A transactional producer under the next id, initialised (fences older producers of it)."""
        if self.ids is not None:
            txn_id, stale = self.ids.next()
            self.fence(stale)
            self.ids.fenced(txn_id)
        else:
            txn_id = self.fallback_id()
        producer = self._producer(txn_id)
        try:
            producer.init_transactions()
        except BaseException:
            close_quietly(producer)
            raise
        self.txn_id = txn_id
        return producer


@dataclass(frozen=True, slots=True)
class Delivered:
    """Where a record landed (kafka-python's ``RecordMetadata`` field names)."""

    topic: str
    partition: int
    offset: int


class Sent:
    """A record's delivery, completed by librdkafka's delivery report (served by ``flush``)."""

    def __init__(self) -> None:
        self.is_done = False
        self.exception: Exception | None = None
        self.value: Delivered | None = None

    def report(self, err: ck.KafkaError | None, msg: Any) -> None:
        if err is not None:
            self.exception = translate(ck.KafkaException(err))
        else:
            self.value = Delivered(msg.topic(), msg.partition(), msg.offset())
        self.is_done = True

    def failed(self) -> bool:
        return self.is_done and self.exception is not None

    def get(self, timeout: float | None = None) -> Delivered:
        if not self.is_done:
            raise KafkaTimeoutError("the record's delivery report has not arrived")
        if self.exception is not None:
            raise self.exception
        assert self.value is not None
        return self.value


class RdProducer:
    """A transactional, idempotent producer on librdkafka with the calls the exactly-once loop
    makes of kafka-python's ``KafkaProducer``. ``disconnects`` counts the broker connections
    librdkafka reported lost; ``kafka_io.ConnectionWatch`` reads it to
    abort a transaction that lived through a reconnect, as it does with kafka-python."""

    def __init__(self, kafka: KafkaSettings, *, transactional_id: str | None = None,
                 transaction_timeout_ms: int | None = None, linger_ms: int = 5,
                 batch_size: int | None = None, max_request_size: int | None = None,
                 **_ignored: Any) -> None:
        max_bytes = max_request_size or kafka.max_message_bytes
        conf: dict[str, Any] = {
            **base_config(kafka),
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": linger_ms,
            "message.max.bytes": max_bytes,
            "error_cb": self._on_error,
        }
        if batch_size:
            conf["batch.size"] = min(batch_size, max_bytes)
        if transactional_id:
            conf["transactional.id"] = transactional_id
        if transaction_timeout_ms:
            conf["transaction.timeout.ms"] = transaction_timeout_ms
            # librdkafka refuses a request timeout longer than the transaction's
            conf["socket.timeout.ms"] = min(conf["socket.timeout.ms"], transaction_timeout_ms)
        self._disconnects = 0
        self._p = configured(ck.Producer, conf)

    @property
    def disconnects(self) -> int:
        """Broker connections lost so far. librdkafka reports them only from ``poll`` or
        ``flush``, so this polls first: a connection that dropped during a commit (which
        flushes before its last request) is counted when the loop asks right after it."""
        self._p.poll(0)
        return self._disconnects

    def _on_error(self, err: ck.KafkaError) -> None:
        if err.code() in DISCONNECTS:
            self._disconnects += 1
        log.info("librdkafka: %s", err.str())

    def init_transactions(self) -> None:
        call(self._p.init_transactions, CALL_TIMEOUT_S)

    def begin_transaction(self) -> None:
        call(self._p.begin_transaction)

    def send(self, topic: str, value: bytes | None = None, key: bytes | None = None,
             headers: list[tuple[str, bytes]] | None = None, partition: int | None = None) -> Sent:
        sent = Sent()
        kw: dict[str, Any] = {"value": value, "key": key, "on_delivery": sent.report}
        if headers:
            kw["headers"] = headers
        if partition is not None:
            kw["partition"] = partition
        while True:
            try:
                call(self._p.produce, topic, **kw)
                break
            except BufferError:  # the local queue is full: let deliveries drain it
                self._p.poll(0.05)
        self._p.poll(0)
        return sent

    def flush(self, timeout: float | None = None) -> None:
        left = self._p.flush(CALL_TIMEOUT_S if timeout is None else timeout)
        if left:
            raise KafkaTimeoutError(f"{left} records not delivered in {timeout}s")

    def send_offsets_to_transaction(self, offsets: Mapping[TopicPartition, Any], group_metadata: Any) -> None:
        parts = [to_ck(tp, om.offset) for tp, om in offsets.items()]
        call(self._p.send_offsets_to_transaction, parts, group_metadata, CALL_TIMEOUT_S)

    def commit_transaction(self) -> None:
        call(self._p.commit_transaction, CALL_TIMEOUT_S)

    def abort_transaction(self) -> None:
        call(self._p.abort_transaction, CALL_TIMEOUT_S)

    def close(self, timeout: float | None = None) -> None:
        """Deliver what is buffered for at most ``timeout`` seconds (0: drop it), then close."""
        if timeout == 0:  # a broken producer: drop what it holds; librdkafka frees it with the object
            self._p.purge(blocking=False)
            self._p.poll(0)
            return
        self._p.flush(timeout or CALL_TIMEOUT_S)
        try:
            self._p.close()
        except (RuntimeError, ck.KafkaException) as exc:
            log.info("closing a librdkafka producer: %s", exc)
