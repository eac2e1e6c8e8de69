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
