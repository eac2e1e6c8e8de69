"""The ingest batch logic (services/ingest_service.IngestWorker.handle) against in-memory
fakes of the consumer, the transactional producer and the dedup store."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pytest
from kafka.errors import KafkaTimeoutError
from kafka.structs import TopicPartition
from pydantic import SecretStr

from ingest.adapters.memory import MemoryDedupStore
from ingest.auth import sign
from ingest.events import EditAccepted
from services.runtime.health import Health
from services.runtime.settings import AuthSettings, Settings
from services.serve_ingest import IngestWorker

NOW = datetime(2026, 11, 22, 10, 0, tzinfo=UTC)
SETTINGS = Settings(auth=AuthSettings(keys={"gw": SecretStr("k")}))
RAW = SETTINGS.topics.raw


@dataclass
class Rec:
    offset: int
    value: bytes | None
    key: bytes | None
    headers: list[tuple[str, bytes]]
    partition: int = 0
    topic: str = RAW
    timestamp: int = 1_795_000_000_000


@dataclass
class FakeProducer:
    committed: list[tuple[str, bytes | None, bytes | None]] = field(default_factory=list)
    offsets: list[dict[TopicPartition, Any]] = field(default_factory=list)
    pending: list[tuple[str, bytes | None, bytes | None]] = field(default_factory=list)
    fail_commit: int = 0
    aborts: int = 0

    def begin_transaction(self) -> None:
        assert not self.pending

    def send(self, topic: str, value: bytes | None = None, key: bytes | None = None,
             headers: list[tuple[str, bytes]] | None = None) -> None:
        self.pending.append((topic, value, key))

    def send_offsets_to_transaction(self, offsets: dict[TopicPartition, Any], group: object) -> None:
        self._offsets = offsets

    def commit_transaction(self) -> None:
        if self.fail_commit:
            self.fail_commit -= 1
            raise KafkaTimeoutError("broker went away")
        self.committed += self.pending
        self.offsets.append(self._offsets)
        self.pending = []

    def abort_transaction(self) -> None:
        self.aborts += 1
        self.pending = []


@dataclass
class FakeConsumer:
    seeks: list[tuple[TopicPartition, int]] = field(default_factory=list)

    def group_metadata(self) -> str:
        return "group"

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.seeks.append((tp, offset))


class BrokenStore:
    def claim_many(self, claims: Any) -> Any:
        raise ConnectionError("redis down")

    def forget(self, event_id: str) -> None: ...


def event(eid: str, rid: str = "r1") -> bytes:
    return EditAccepted(event_id=eid, request_id=rid, ts=NOW, inserted_chars=1).model_dump_json().encode()


def rec(offset: int, value: bytes, key: bytes | None = b"r1", signed: bool = True) -> Rec:
    headers = [("rtrl-key-id", b"gw"), ("rtrl-signature", sign(value, b"k").encode())] if signed else []
    return Rec(offset, value, key, headers)


Fakes = tuple[IngestWorker, FakeProducer, FakeConsumer]


def worker(store: Any = None, settings: Settings = SETTINGS) -> Fakes:
    prod, cons = FakeProducer(), FakeConsumer()
    w = IngestWorker(settings, cons, prod, store or MemoryDedupStore(60), Health(),  # type: ignore[arg-type]
                     "g", 100, clock=lambda: NOW)
    return w, prod, cons


TP = TopicPartition(RAW, 0)


def test_batch_forwards_dead_letters_and_commits_offsets_together() -> None:
    w, prod, _ = worker()
    batch = {TP: [rec(10, event("a")), rec(11, b"{oops"), rec(12, event("a")),
                  rec(13, event("b"), signed=False)]}
    result = w.handle(batch, "events", "dlq")
    assert result is not None
    assert (result.valid, result.duplicate, dict(result.rejected)) == (1, 1, {"bad_json": 1, "unsigned": 1})
    assert [(t, k) for t, _, k in prod.committed] == [("events", b"r1"), ("dlq", b"r1"), ("dlq", b"r1")]
    assert prod.offsets == [{TP: (14, "", -1)}]
    dlq = json.loads(prod.committed[1][1] or b"")
    assert dlq["reason"] == "bad_json" and base64.b64decode(dlq["original_b64"]) == b"{oops"
    assert dlq["source"] == {"topic": RAW, "partition": 0, "offset": 11,
                             "key": base64.b64encode(b"r1").decode(), "timestamp_ms": 1_795_000_000_000}
    assert dlq["headers"] == ["rtrl-key-id", "rtrl-signature"]
    assert dlq["received_at"] == "2026-11-22T10:00:00Z"


def test_failed_commit_aborts_rewinds_and_the_replay_is_not_a_duplicate() -> None:
    w, prod, cons = worker()
    prod.fail_commit = 1
    batch = {TP: [rec(5, event("x")), rec(6, event("y"))]}
    assert w.handle(batch, "events", "dlq") is None
    assert prod.aborts == 1 and prod.committed == [] and cons.seeks == [(TP, 5)]
    # the same records come back after the rewind: their ids are claimed by themselves
    result = w.handle(batch, "events", "dlq")
    assert result is not None and result.valid == 2 and result.duplicate == 0
    assert len(prod.committed) == 2


def test_dedup_store_down_holds_the_batch_until_stopped() -> None:
    from services.runtime.process import Stopper

    w, prod, cons = worker(store=BrokenStore())
    stopper = Stopper()
    stopper.stop()  # asked to stop while the store is down: give the batch back, commit nothing
    assert w.handle({TP: [rec(1, event("a"))]}, "events", "dlq", stopper) is None
    assert prod.committed == [] and cons.seeks == [(TP, 1)]


def test_duplicates_can_be_dead_lettered() -> None:
    s = SETTINGS.model_copy(update={"ingest": SETTINGS.ingest.model_copy(update={"dlq_duplicates": True})})
    w, prod, _ = worker(settings=s)
    result = w.handle({TP: [rec(1, event("a")), rec(2, event("a"))]}, "events", "dlq")
    assert result is not None and result.rejected == {"duplicate": 1}
    doc = json.loads(prod.committed[1][1] or b"")
    assert doc["reason"] == "duplicate" and f"{RAW}:0:1" in doc["detail"]


@pytest.mark.parametrize("value", [None, b""])
def test_tombstones_are_dead_lettered(value: bytes | None) -> None:
    w, prod, _ = worker()
    r = Rec(3, value, None, [("rtrl-key-id", b"gw"), ("rtrl-signature", sign(b"", b"k").encode())])
    result = w.handle({TP: [r]}, "events", "dlq")
    assert result is not None and result.rejected == {"bad_json": 1}
    assert json.loads(prod.committed[0][1] or b"")["original_b64"] == ""


def test_huge_originals_are_truncated_so_the_dlq_record_fits() -> None:
    w, prod, _ = worker()
    big = b"x" * (900 * 1024)  # under a 1 MiB broker limit, far over ingest's 256 KiB
    result = w.handle({TP: [rec(4, big)]}, "events", "dlq")
    assert result is not None and result.rejected == {"oversized": 1}
    value = prod.committed[0][1] or b""
    assert len(value) < 1024 * 1024 - 1024
    doc = json.loads(value)
    assert doc["original_truncated"] is True and doc["original_size"] == len(big)
    assert base64.b64decode(doc["original_b64"]) == big[: 512 * 1024]


def test_huge_keys_and_many_headers_are_capped_in_the_dlq() -> None:
    w, prod, _ = worker()
    r = Rec(5, b"{", b"k" * 500_000, [(f"h{i}" * 50, b"v") for i in range(1000)])
    result = w.handle({TP: [r]}, "events", "dlq")
    assert result is not None and result.rejected == {"unsigned": 1}
    _, value, key = prod.committed[0]
    assert key == b"k" * 1024
    doc = json.loads(value or b"")
    assert len(doc["headers"]) == 64 and all(len(h) <= 256 for h in doc["headers"])
    assert base64.b64decode(doc["source"]["key"]) == b"k" * 1024
