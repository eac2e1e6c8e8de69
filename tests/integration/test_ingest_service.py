"""Ingest against the real broker and Redis: forwarding, DLQ, dedup, auth, clean stop."""

from __future__ import annotations

import base64
import json
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from kafka import KafkaConsumer, TopicPartition
from pydantic import SecretStr

from ingest.events import CompletionServed, EditAccepted, ModelRef, parse_event
from services.runtime.event_producer import EventProducer
from services.runtime.kafka_io import ensure_topics, make_consumer
from services.runtime.process import Stopper
from services.settings.model import AuthSettings, Settings
from services.settings.services import IngestSettings
from services.wiring.ingest import run_worker

SECRET = "test-secret"


def with_auth(settings: Settings, **ingest: Any) -> Settings:
    group = f"ingest-{settings.topics.raw}"
    return settings.model_copy(update={
        "auth": AuthSettings(keys={"gw": SecretStr(SECRET)}),
        "ingest": IngestSettings(**{"poll_timeout_ms": 100, "group_id": group, **ingest}),
    })


def committed_total(settings: Settings) -> int:
    """Sum of the ingest group's committed offsets on the raw topic."""
    consumer = make_consumer(settings.kafka, settings.ingest.group_id)
    try:
        parts = consumer.partitions_for_topic(settings.topics.raw) or set()
        return sum(consumer.committed(TopicPartition(settings.topics.raw, p)) or 0 for p in parts)
    finally:
        consumer.close(autocommit=False)


def served(request_id: str, event_id: str | None = None) -> CompletionServed:
    return CompletionServed(
        event_id=event_id or f"s-{uuid.uuid4().hex[:12]}", request_id=request_id,
        ts=datetime.now(UTC), session_id="sess", user_key="u1",
        model=ModelRef(name="rtrl-policy", version="1"), arm="stable",
        prompt_tokens=[1, 2], completion_tokens=[3], logprobs=[-0.5], latency_ms=12.0,
    )


def accepted(request_id: str, event_id: str | None = None) -> EditAccepted:
    return EditAccepted(event_id=event_id or f"a-{uuid.uuid4().hex[:12]}", request_id=request_id,
                        ts=datetime.now(UTC), inserted_chars=10)


def read_all(settings: Settings, topic: str, expect: int, timeout_s: float = 20.0,
             settle_s: float = 0.5) -> list[Any]:
    """Every committed record of ``topic`` once ``expect`` arrived (then ``settle_s`` more)."""
    consumer: KafkaConsumer = make_consumer(settings.kafka, None)
    parts = consumer.partitions_for_topic(topic) or set()
    deadline = time.monotonic() + timeout_s
    while not parts and time.monotonic() < deadline:
        time.sleep(0.1)
        parts = consumer.partitions_for_topic(topic) or set()
    consumer.assign([TopicPartition(topic, p) for p in parts])
    consumer.seek_to_beginning()
    out: list[Any] = []
    settle_until: float | None = None
    while time.monotonic() < deadline:
        for recs in consumer.poll(timeout_ms=200).values():
            out.extend(recs)
        if len(out) >= expect:
            settle_until = settle_until or time.monotonic() + settle_s
            if time.monotonic() >= settle_until:
                break
    consumer.close()
    return out


class Running:
    def __init__(self, settings: Settings, **kw: Any) -> None:
        self.stopper = Stopper()
        self.code: int | None = None
        self.port: int | None = None

        def target() -> None:
            self.code = run_worker(settings, self.stopper, on_ready=self._ready, **kw)

        self.thread = threading.Thread(target=target, daemon=True)
        self.thread.start()

    def _ready(self, http: Any) -> None:
        self.port = http.port

    def stop(self) -> int | None:
        self.stopper.stop()
        self.thread.join(30)
        assert not self.thread.is_alive(), "ingest worker did not stop"
        return self.code


@pytest.fixture
def ingest(settings: Settings) -> Iterator[Settings]:
    s = with_auth(settings)
    worker = Running(s)
    yield s
    assert worker.stop() == 0


def test_valid_events_forwarded_keyed_by_request_id(ingest: Settings) -> None:
    sent = []
    with EventProducer(ingest, "gw", SECRET) as p:
        for i in range(20):
            rid = f"req-{i}"
            for ev in (served(rid), accepted(rid)):
                p.send(ev)
                sent.append(ev)
    out = read_all(ingest, ingest.topics.events, len(sent))
    assert sorted(r.value for r in out) == sorted(e.model_dump_json().encode() for e in sent)
    partitions: dict[bytes, set[int]] = {}
    for r in out:
        ev = parse_event(r.value)
        assert r.key == ev.request_id.encode()
        partitions.setdefault(r.key, set()).add(r.partition)
    assert all(len(p) == 1 for p in partitions.values()), "a request's events must share a partition"
    assert len({p for ps in partitions.values() for p in ps}) > 1, "requests should spread over partitions"
    assert read_all(ingest, ingest.topics.dlq, 0, timeout_s=1, settle_s=0.3) == []


def test_bad_input_dead_lettered_with_reason_bytes_and_source(ingest: Settings) -> None:
    good = served("r-ok")
    cases: list[tuple[bytes, list[tuple[str, bytes]], bytes | None, bool, str]] = [
        (b"{not json", [], b"r1", True, "bad_json"),
        (b"\xff\xfe\x00", [], None, True, "not_utf8"),
        (b"[1,2,3]", [], None, True, "not_object"),
        (b"[" + b" " * 300_000 + b"]", [], None, True, "oversized"),
        (json.dumps({**json.loads(good.model_dump_json()), "latency_ms": -5}).encode(), [], b"r-ok", True,
         "invalid_field"),
        (served("r-ok").model_dump_json().encode(), [], b"r-ok", False, "unsigned"),
        (good.model_dump_json().encode(), [("rtrl-key-id", b"gw"), ("rtrl-signature", b"00" * 32)], b"r-ok",
         False, "bad_signature"),
        (accepted("r-2").model_dump_json().encode(), [], b"other-key", True, "key_mismatch"),
    ]
    with EventProducer(ingest, "gw", SECRET) as p:
        for value, headers, key, sign_it, _ in cases:
            p.send_raw(value, headers=headers, key=key, sign_value=sign_it)
    out = read_all(ingest, ingest.topics.dlq, len(cases))
    assert len(out) == len(cases)
    raw_offsets = set()
    by_original = {base64.b64decode(json.loads(r.value)["original_b64"]): json.loads(r.value) for r in out}
    for value, headers, key, sign_it, reason in cases:
        doc = by_original[value]
        assert doc["reason"] == reason, doc
        assert doc["detail"]
        src = doc["source"]
        assert src["topic"] == ingest.topics.raw
        assert src["key"] == (base64.b64encode(key).decode() if key is not None else None)
        assert isinstance(src["timestamp_ms"], int)
        raw_offsets.add((src["partition"], src["offset"]))
        assert doc["headers"] == [name for name, _ in headers] + (
            ["rtrl-key-id", "rtrl-signature"] if sign_it else [])
        assert datetime.fromisoformat(doc["received_at"]) > datetime.now(UTC) - timedelta(minutes=5)
    assert len(raw_offsets) == len(cases)
    # header names only: the signature values never reach the DLQ
    assert all(b"00" * 32 not in r.value for r in out)
    assert all(r.headers == [("rtrl-reason", json.loads(r.value)["reason"].encode())] for r in out)
    assert read_all(ingest, ingest.topics.events, 0, timeout_s=1, settle_s=0.3) == []


def test_duplicates_dropped(ingest: Settings) -> None:
    first = served("r-dup", event_id="dup-1")
    with EventProducer(ingest, "gw", SECRET) as p:
        p.send(first)
        p.send(first)  # a producer retry
        p.send(accepted("r-dup", event_id="dup-1"))  # same id, different body: still a duplicate
        p.send(accepted("r-dup", event_id="dup-2"))
    out = read_all(ingest, ingest.topics.events, 2, settle_s=1.5)
    assert sorted(parse_event(r.value).event_id for r in out) == ["dup-1", "dup-2"]
    assert parse_event(next(r.value for r in out if b"dup-1" in r.value)) == first


def test_unsigned_accepted_only_when_allowed(settings: Settings) -> None:
    dev = with_auth(settings).model_copy(
        update={"auth": AuthSettings(keys={"gw": SecretStr(SECRET)}, allow_unsigned=True)})
    worker = Running(dev)
    try:
        with EventProducer(dev, None, None) as p:
            p.send(served("r-u"))
        with EventProducer(dev, "gw", "wrong-secret") as p:
            p.send(served("r-u"))
        assert len(read_all(dev, dev.topics.events, 1)) == 1
        [dlq] = read_all(dev, dev.topics.dlq, 1)
        assert json.loads(dlq.value)["reason"] == "bad_signature"
    finally:
        assert worker.stop() == 0


def test_offsets_committed_with_the_batch(ingest: Settings) -> None:
    with EventProducer(ingest, "gw", SECRET) as p:
        for i in range(10):
            p.send(served(f"c-{i}"))
    assert len(read_all(ingest, ingest.topics.events, 10)) == 10
    deadline = time.monotonic() + 10
    while committed_total(ingest) < 10 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert committed_total(ingest) == 10


def test_two_workers_share_partitions_and_hand_over_on_stop(settings: Settings) -> None:
    s = with_auth(settings, max_batch=20)
    ensure_topics(s)
    first, second = Running(s), Running(s)
    ids: set[str] = set()
    try:
        with EventProducer(s, "gw", SECRET) as p:
            for i in range(300):
                ev = served(f"h-{i}")
                p.send(ev)
                ids.add(ev.event_id)
        assert len(read_all(s, s.topics.events, 150, settle_s=0)) >= 150
        assert first.stop() == 0  # clean leave mid-stream: the other worker takes over
        with EventProducer(s, "gw", SECRET) as p:
            for i in range(300, 400):
                ev = served(f"h-{i}")
                p.send(ev)
                ids.add(ev.event_id)
        out = read_all(s, s.topics.events, len(ids), timeout_s=30, settle_s=1.0)
    finally:
        first.stop()
        assert second.stop() == 0
    got = [parse_event(r.value).event_id for r in out]
    assert sorted(got) == sorted(ids), "every event exactly once across the hand-over"
