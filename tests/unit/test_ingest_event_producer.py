from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from ingest.auth import AuthPolicy, authenticate
from ingest.events import EditAccepted, parse_event
from services.runtime.event_producer import EventProducer
from services.settings.model import Settings, TopicSettings


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


def test_an_event_larger_than_ingest_accepts_is_refused_before_sending() -> None:
    from ingest.events import FollowupDissatisfied
    from services.runtime.event_producer import EventTooLargeError
    from services.settings.services import IngestSettings

    small = Settings(topics=TopicSettings(raw="raw-x"), ingest=IngestSettings(max_bytes=300))
    fake = ListProducer()
    p = EventProducer(small, "gw", "k3y", producer=fake)
    p.send(EVENT)  # well under 300 bytes
    big = FollowupDissatisfied(event_id="e2", request_id="r1", ts=datetime(2026, 1, 1, tzinfo=UTC),
                               reason="x" * 200)
    with pytest.raises(EventTooLargeError, match="RTRL_INGEST__MAX_BYTES"):
        p.send(big)
    assert len(fake.sent) == 1


def test_settings_refuse_an_event_limit_that_no_record_can_hold() -> None:
    from pydantic import ValidationError

    from services.settings.model import KafkaSettings
    from services.settings.services import IngestSettings

    event_max = IngestSettings(max_bytes=256 * 1024)
    with pytest.raises(ValidationError, match="MAX_MESSAGE_BYTES"):
        Settings(kafka=KafkaSettings(max_message_bytes=256 * 1024), ingest=event_max)
    ok = Settings(kafka=KafkaSettings(max_message_bytes=300 * 1024), ingest=event_max)
    assert ok.kafka.max_message_bytes == 300 * 1024
    assert Settings().kafka.max_message_bytes == 1_000_000


@pytest.mark.parametrize("limit", [64 * 1024, 200_000, 700_000, 1_000_000, 8 * 1024 * 1024])
def test_a_dlq_record_of_the_largest_original_fits_one_record(limit: int) -> None:
    import json
    from types import SimpleNamespace

    from ingest.validate import DETAIL_MAX, Rejected
    from services.wiring.ingest import DLQ_KEY_MAX, DLQ_ORIGINAL_MAX, dlq_original_max, dlq_record

    most = dlq_original_max(limit)
    assert most <= DLQ_ORIGINAL_MAX
    worst_headers = [("\U0001f600" * 300, b"v")] * 100  # each character JSON-escaped to 12 bytes
    rec = SimpleNamespace(key=b"k" * DLQ_KEY_MAX, value=b"\xff" * (most + 10), topic="t" * 249,
                          partition=2**31, offset=2**63 - 1, timestamp=2**63 - 1, headers=worst_headers)
    value = dlq_record(rec, Rejected("oversized", "d" * DETAIL_MAX), datetime(2026, 1, 1, tzinfo=UTC), most)
    assert len(value) + DLQ_KEY_MAX + 1024 <= limit
    assert json.loads(value)["original_truncated"] is True
