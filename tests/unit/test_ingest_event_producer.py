from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from ingest.auth import AuthPolicy, authenticate
from ingest.events import EditAccepted, parse_event
from services.runtime.event_producer import EventProducer
from services.runtime.settings import Settings, TopicSettings


class ListProducer:
    """In-memory stand-in for KafkaProducer: records what was sent."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.flushed = 0
        self.closed = False

    def send(self, topic: str, value: bytes | None = None, key: bytes | None = None,
             headers: list[tuple[str, bytes]] | None = None) -> None:
        self.sent.append({"topic": topic, "value": value, "key": key, "headers": headers})

    def flush(self, timeout: float | None = None) -> None:
        self.flushed += 1

    def close(self, timeout: float | None = None) -> None:
        self.closed = True


SETTINGS = Settings(topics=TopicSettings(raw="raw-x"))
EVENT = EditAccepted(event_id="e1", request_id="r1", ts=datetime(2026, 1, 1, tzinfo=UTC), inserted_chars=3)


def test_send_signs_keys_and_serialises() -> None:
    fake = ListProducer()
    with EventProducer(SETTINGS, "gw", "k3y", producer=fake) as p:
        p.send(EVENT)
    assert fake.flushed == 1 and fake.closed
    [rec] = fake.sent
    assert rec["topic"] == "raw-x" and rec["key"] == b"r1"
    assert parse_event(rec["value"]) == EVENT
    assert authenticate(rec["value"], rec["headers"], AuthPolicy(keys={"gw": b"k3y"})) is None
    assert authenticate(rec["value"], rec["headers"], AuthPolicy(keys={"gw": b"nope"})) is not None


def test_unsigned_and_raw() -> None:
    fake = ListProducer()
    p = EventProducer(SETTINGS, None, None, producer=fake)
    p.send(EVENT)
    p.send_raw(b"\xff", headers=[("x", b"1")], key=b"k")
    assert fake.sent[0]["headers"] == []
    assert fake.sent[1] == {"topic": "raw-x", "value": b"\xff", "key": b"k", "headers": [("x", b"1")]}
    failure = authenticate(fake.sent[0]["value"], fake.sent[0]["headers"], AuthPolicy(keys={}))
    assert failure is not None and failure.reason == "unsigned"


def test_send_raw_can_sign() -> None:
    fake = ListProducer()
    p = EventProducer(SETTINGS, "gw", b"k", producer=fake)
    p.send_raw(b"not json", sign_value=True)
    rec = fake.sent[0]
    assert authenticate(b"not json", rec["headers"], AuthPolicy(keys={"gw": b"k"})) is None


def test_key_id_without_secret_is_an_error() -> None:
    with pytest.raises(ValueError, match="needs a secret"):
        EventProducer(SETTINGS, "gw", None, producer=ListProducer())
