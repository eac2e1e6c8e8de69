"""ConnectionWatch: a transaction that lived through a reconnect is not trusted."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from services.runtime.kafka_io import ConnectionWatch

pytestmark = pytest.mark.unit


def producer_with(conns: dict[int, Any]) -> Any:
    """The shape of kafka-python 3.0's producer down to its connection table."""
    manager = SimpleNamespace(_conns=conns)
    return SimpleNamespace(_sender=SimpleNamespace(_client=SimpleNamespace(_manager=manager)))


def conn(closed: bool = False) -> Any:
    return SimpleNamespace(closed=closed)


def test_the_same_open_connections_are_not_an_interruption() -> None:
    a, b = conn(), conn()
    conns = {1: a, 2: b}
    watch = ConnectionWatch(producer_with(conns))
    assert not watch.interrupted()


def test_a_connection_opened_during_the_transaction_is_not_an_interruption() -> None:
    conns: dict[int, Any] = {1: conn()}
    watch = ConnectionWatch(producer_with(conns))
    conns[2] = conn()
    assert not watch.interrupted()


def test_a_closed_connection_is_an_interruption() -> None:
    a = conn()
    watch = ConnectionWatch(producer_with({1: a}))
    a.closed = True
    assert watch.interrupted()


def test_a_dropped_or_replaced_connection_is_an_interruption() -> None:
    conns: dict[int, Any] = {1: conn()}
    watch = ConnectionWatch(producer_with(conns))
    del conns[1]
    assert watch.interrupted()
    conns[1] = conn()  # reconnected: a new connection object for the same node
    assert watch.interrupted()


def test_a_producer_without_a_connection_table_is_never_interrupted() -> None:
    watch = ConnectionWatch(SimpleNamespace())
    assert not watch.watching
    assert not watch.interrupted()


class FlushingProducer:
    """A producer whose sends stay pending (its flush always times out) until ``drop`` closes
    its one connection; records whether it was abandoned (kafka-python's ``force_close``)."""

    def __init__(self) -> None:
        self.connection = conn()
        self.flushes = 0
        self.closed_sender = False
        manager = SimpleNamespace(_conns={1: self.connection})
        self._sender = SimpleNamespace(_client=SimpleNamespace(_manager=manager), _force_close=False,
                                       force_close=self._force_close)

    def _force_close(self) -> None:
        self._sender._force_close = True
        self.closed_sender = True

    def flush(self, timeout: float | None = None) -> None:
        from kafka.errors import KafkaTimeoutError

        self.flushes += 1
        if self.flushes == 3:
            self.connection.closed = True  # the broker stops while the batch is in flight
        raise KafkaTimeoutError("pending")


def test_a_connection_lost_with_sends_pending_abandons_the_producer_instead_of_resending() -> None:
    from services.runtime.kafka_io import TransactionInterruptedError, check_sent, end_transaction

    prod = FlushingProducer()
    watch = ConnectionWatch(prod)
    with pytest.raises(TransactionInterruptedError, match="dropped while sends were pending"):
        check_sent(prod, [], timeout_s=5.0, watch=watch)
    assert prod.closed_sender and prod.flushes == 3
    prod._transaction_manager = object()  # type: ignore[attr-defined]
    with pytest.raises(Exception, match="abandoned"):  # no 5 s wait for an abort nobody sends
        end_transaction(prod, commit=False, timeout_s=5.0)


def test_pending_sends_without_a_drop_wait_out_the_timeout_and_keep_the_producer() -> None:
    from kafka.errors import KafkaTimeoutError

    from services.runtime.kafka_io import check_sent

    class Slow(FlushingProducer):
        def flush(self, timeout: float | None = None) -> None:
            self.flushes += 1
            raise KafkaTimeoutError("pending")

    prod = Slow()
    check_sent(prod, [], timeout_s=0.2, watch=ConnectionWatch(prod))
    assert not prod.closed_sender and prod.flushes >= 2
