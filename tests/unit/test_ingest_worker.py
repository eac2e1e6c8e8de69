"""Ingest's batch transform (services/serve_ingest.IngestTransform) inside the exactly-once
loop, against in-memory doubles of the consumer, the transactional producer and the
dedup store."""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime
from typing import Any

import pytest
import redis
from kafka.structs import TopicPartition
from kafka_fakes import FakeConsumer, FakeProducer, Rec
from pydantic import SecretStr

from ingest.adapters.memory import MemoryDedupStore
from ingest.auth import sign
from ingest.events import EditAccepted
from services.runtime.exactly_once import ExactlyOnceLoop
from services.runtime.health import Health
from services.runtime.process import Stopper
from services.settings.model import AuthSettings, Settings
from services.wiring.ingest import IngestCounts, IngestTransform

NOW = datetime(2026, 11, 22, 10, 0, tzinfo=UTC)
SETTINGS = Settings(auth=AuthSettings(keys={"gw": SecretStr("k")}))
RAW = SETTINGS.topics.raw
EVENTS, DLQ = SETTINGS.topics.events, SETTINGS.topics.dlq
TP = TopicPartition(RAW, 0)


class BrokenStore:
    def claim_many(self, claims: Any) -> Any:
        raise redis.ConnectionError("redis down")

    def forget(self, event_id: str) -> None: ...


class Worker:
    """One ingest worker: the transform in the loop, with the doubles it talks to."""

    def __init__(self, store: Any = None, settings: Settings = SETTINGS) -> None:
        self.consumer = FakeConsumer([TP])
        self.producers: list[FakeProducer] = []
        self.transform = IngestTransform(settings, store or MemoryDedupStore(60), clock=lambda: NOW)
        self.loop = ExactlyOnceLoop("ingest", self.consumer, self._open,  # type: ignore[arg-type]
                                    self.transform, Health(), poll_timeout_ms=10, max_records=100)
        self.loop.start([RAW])

    def _open(self) -> FakeProducer:
        self.producers.append(FakeProducer())
        return self.producers[-1]

    @property
    def prod(self) -> FakeProducer:
        return self.producers[-1]

    def handle(self, batch: dict[TopicPartition, list[Rec]]) -> IngestCounts | None:
        """One iteration on this batch; its counts when it committed."""
        self.consumer.batches.append(batch)
        done = self.loop.step()
        return done.result if done is not None else None

    def committed(self) -> list[tuple[str, bytes | None, bytes | None]]:
        return [(t, v, k) for t, v, k, _ in self.prod.committed]


def event(eid: str, rid: str = "r1") -> bytes:
    return EditAccepted(event_id=eid, request_id=rid, ts=NOW, inserted_chars=1).model_dump_json().encode()


def rec(offset: int, value: bytes | None, key: bytes | None = b"r1", signed: bool = True) -> Rec:
    signature = sign(value or b"", b"k").encode()
    headers = [("rtrl-key-id", b"gw"), ("rtrl-signature", signature)] if signed else []
    return Rec(offset, value, key, headers, topic=RAW)


def test_batch_forwards_dead_letters_and_commits_offsets_together() -> None:
    w = Worker()
    batch = {TP: [rec(10, event("a")), rec(11, b"{oops"), rec(12, event("a")),
                  rec(13, event("b"), signed=False)]}
    result = w.handle(batch)
    assert result is not None
    assert (result.valid, result.duplicate, dict(result.rejected)) == (1, 1, {"bad_json": 1, "unsigned": 1})
    assert [(t, k) for t, _, k in w.committed()] == [(EVENTS, b"r1"), (DLQ, b"r1"), (DLQ, b"r1")]
    assert w.prod.offsets == [{TP: (14, "", -1)}]
    dlq = json.loads(w.committed()[1][1] or b"")
    assert dlq["reason"] == "bad_json" and base64.b64decode(dlq["original_b64"]) == b"{oops"
    assert dlq["source"] == {"topic": RAW, "partition": 0, "offset": 11,
                             "key": base64.b64encode(b"r1").decode(), "timestamp_ms": 1_795_000_000_000}
    assert dlq["headers"] == ["rtrl-key-id", "rtrl-signature"]
    assert dlq["received_at"] == "2026-11-22T10:00:00Z"


def test_failed_commit_aborts_rewinds_and_the_replay_is_not_a_duplicate() -> None:
    w = Worker()
    w.consumer.committed_offsets = {TP: 5}
    batch = {TP: [rec(5, event("x")), rec(6, event("y"))]}
    w.prod.fail_commit = 1
    first = w.prod
    w.consumer.batches += [batch, batch]  # the broker hands the batch back after the rewind
    stopper = Stopper()
    w.loop.step = _stop_when_drained(w, stopper)  # type: ignore[method-assign]
    w.loop.run(stopper)
    assert first.aborts == 1 and first.committed == [] and w.consumer.seeks == [(TP, 5)]
    # the same records came back after the rewind: their ids are claimed by themselves
    assert [t for t, _, _ in w.committed()] == [EVENTS, EVENTS]
    assert w.prod is not first, "a transaction that failed retires its producer"


def test_dedup_store_down_commits_nothing_and_rewinds() -> None:
    w = Worker(store=BrokenStore())
    stopper = Stopper()
    w.consumer.batches.append({TP: [rec(1, event("a"))]})
    w.consumer.committed_offsets = {TP: 1}
    stopper.wait = lambda timeout=None: stopper.stop() or True  # type: ignore[method-assign,func-returns-value]
    w.loop.run(stopper)  # asked to stop while the store is down: give the batch back
    assert w.prod.committed == [] and w.loop.failing == "redis"
    w.loop._reset()  # what the next iteration does first
    assert w.consumer.seeks == [(TP, 1)] and len(w.producers) == 1


def test_duplicates_can_be_dead_lettered() -> None:
    s = SETTINGS.model_copy(update={"ingest": SETTINGS.ingest.model_copy(update={"dlq_duplicates": True})})
    w = Worker(settings=s)
    result = w.handle({TP: [rec(1, event("a")), rec(2, event("a"))]})
    assert result is not None and result.rejected == {"duplicate": 1}
    doc = json.loads(w.committed()[1][1] or b"")
    assert doc["reason"] == "duplicate" and f"{RAW}:0:1" in doc["detail"]


@pytest.mark.parametrize("value", [None, b""])
def test_tombstones_are_dead_lettered(value: bytes | None) -> None:
    w = Worker()
    result = w.handle({TP: [rec(3, value, key=None)]})
    assert result is not None and result.rejected == {"bad_json": 1}
    assert json.loads(w.committed()[0][1] or b"")["original_b64"] == ""


def test_huge_originals_are_truncated_so_the_dlq_record_fits() -> None:
    w = Worker()
    big = b"x" * (900 * 1024)  # under a 1 MiB broker limit, far over ingest's 256 KiB
    result = w.handle({TP: [rec(4, big)]})
    assert result is not None and result.rejected == {"oversized": 1}
    value = w.committed()[0][1] or b""
    assert len(value) < 1024 * 1024 - 1024
    doc = json.loads(value)
    assert doc["original_truncated"] is True and doc["original_size"] == len(big)
    assert base64.b64decode(doc["original_b64"]) == big[: 512 * 1024]


def test_huge_keys_and_many_headers_are_capped_in_the_dlq() -> None:
    w = Worker()
    r = Rec(5, b"{", b"k" * 500_000, [(f"h{i}" * 50, b"v") for i in range(1000)], topic=RAW)
    result = w.handle({TP: [r]})
    assert result is not None and result.rejected == {"unsigned": 1}
    _, value, key = w.committed()[0]
    assert key == b"k" * 1024
    doc = json.loads(value or b"")
    assert len(doc["headers"]) == 32 and all(len(h) <= 64 for h in doc["headers"])
    assert base64.b64decode(doc["source"]["key"]) == b"k" * 1024


def _stop_when_drained(w: Worker, stopper: Stopper) -> Any:
    """The loop's step, stopping the run once no batch is left; backoff without sleeping."""
    step = w.loop.step
    stopper.wait = lambda timeout=None: False  # type: ignore[method-assign]

    def once() -> Any:
        try:
            return step()
        finally:
            if not w.consumer.batches:
                stopper.stop()
    return once
