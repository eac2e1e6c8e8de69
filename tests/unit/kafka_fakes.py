"""In-memory doubles of a kafka-python consumer group member and transactional producer,
for the exactly-once loop's unit tests (the integration tier runs the real broker)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from kafka.errors import KafkaTimeoutError
from kafka.structs import TopicPartition


@dataclass
class Rec:
    """A consumed record, as kafka-python's ConsumerRecord has it."""

    offset: int
    value: bytes | None
    key: bytes | None = None
    headers: list[tuple[str, bytes]] = field(default_factory=list)
    partition: int = 0
    topic: str = "in"
    timestamp: int = 1_795_000_000_000


@dataclass
class Meta:
    """RecordMetadata of a delivered record."""

    topic: str
    partition: int
    offset: int


class Future:
    def __init__(self, meta: Meta) -> None:
        self.meta = meta
        self.is_done = True

    def failed(self) -> bool:
        return False

    def get(self, timeout: float | None = None) -> Meta:
        return self.meta


@dataclass
class FakeProducer:
    """Committed records are (topic, value, key, partition); a transaction's sends are
    visible only once committed. ``fail_commit`` commits fail with a Kafka timeout."""

    committed: list[tuple[str, bytes | None, bytes | None, int | None]] = field(default_factory=list)
    offsets: list[dict[TopicPartition, Any]] = field(default_factory=list)
    pending: list[tuple[str, bytes | None, bytes | None, int | None]] = field(default_factory=list)
    fail_commit: int = 0
    aborts: int = 0
    closed: bool = False
    _offsets: dict[TopicPartition, Any] = field(default_factory=dict)

    def begin_transaction(self) -> None:
        assert not self.pending, "a transaction is already open"

    def send(self, topic: str, value: bytes | None = None, key: bytes | None = None,
             headers: list[tuple[str, bytes]] | None = None, partition: int | None = None) -> Future:
        self.pending.append((topic, value, key, partition))
        offset = sum(1 for c in self.committed if c[0] == topic) + len(self.pending) - 1
        return Future(Meta(topic, partition or 0, offset))

    def send_offsets_to_transaction(self, offsets: dict[TopicPartition, Any], group: object) -> None:
        self._offsets = offsets

    def commit_transaction(self) -> None:
        if self.fail_commit:
            self.fail_commit -= 1
            raise KafkaTimeoutError("broker went away")
        self.committed += self.pending
        self.offsets.append(self._offsets)
        self.pending, self._offsets = [], {}

    def abort_transaction(self) -> None:
        self.aborts += 1
        self.pending, self._offsets = [], {}

    def close(self, timeout: float | None = None) -> None:
        self.closed = True


class FakeConsumer:
    """A group member owning ``partitions``; ``poll`` hands out queued batches and keeps the
    position; ``committed`` follows the offsets the test commits through ``commit_to``."""

    def __init__(self, partitions: list[TopicPartition]) -> None:
        self.partitions = partitions
        self.batches: deque[dict[TopicPartition, list[Rec]]] = deque()
        self.seeks: list[tuple[TopicPartition, int]] = []
        self.committed_offsets: dict[TopicPartition, int] = {}
        self.listener: Any = None
        self.poll_error: Exception | None = None

    def subscribe(self, topics: list[str], listener: Any = None) -> None:
        self.listener = listener
        listener.on_partitions_assigned(self.partitions)

    def poll(self, timeout_ms: int = 0, max_records: int | None = None) -> dict[TopicPartition, list[Rec]]:
        if self.poll_error is not None:
            err, self.poll_error = self.poll_error, None
            raise err
        return self.batches.popleft() if self.batches else {}

    def assignment(self) -> set[TopicPartition]:
        return set(self.partitions)

    def committed(self, tp: TopicPartition, timeout_ms: int | None = None) -> int | None:
        return self.committed_offsets.get(tp)

    def seek(self, tp: TopicPartition, offset: int) -> None:
        if tp not in self.partitions:  # kafka-python's message
            raise ValueError("Unassigned partition")
        self.seeks.append((tp, offset))

    def seek_to_beginning(self, *tps: TopicPartition) -> None:
        for tp in tps:
            if tp not in self.partitions:
                raise ValueError(f"Unassigned partition: {tp}")
        self.seeks += [(tp, 0) for tp in tps]

    def group_metadata(self) -> str:
        return "group"

    def end_offsets(self, tps: list[TopicPartition],
                    timeout_ms: int | None = None) -> dict[TopicPartition, int]:
        return {tp: 0 for tp in tps}

    def position(self, tp: TopicPartition, timeout_ms: int | None = None) -> int:
        return 0

    def topics(self) -> set[str]:
        return {tp.topic for tp in self.partitions}

    def close(self, autocommit: bool = True) -> None:
        pass
