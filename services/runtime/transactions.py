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
from collections.abc import Callable, Iterable
from typing import Any

from kafka import KafkaProducer

from ingest.contracts.keys import fenced_key
from ingest.contracts.transactions import generation_id, generation_of, process_id
from services.runtime.kafka_io import close_quietly, make_transactional_producer
from services.settings.model import KafkaSettings

log = logging.getLogger("rtrl.exactly_once")


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
