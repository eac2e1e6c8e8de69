"""The rewards topic on Kafka: :class:`trainer.window.RewardLog` with a consumer group.

The cut is the group's committed offsets (``trainer.consumer_group``); the watermark is the
end offset read under ``read_committed`` (the last stable offset), so an open reward
transaction holds the watermark back instead of leaking uncommitted records into a window.
The consumer never subscribes: it assigns the partitions, seeks to each range's start and
reads until its position passes the range's end (transaction markers occupy offsets too).
The caller opens the consumer (services/wiring/trainer.py) and hands it over; ``close`` closes it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from kafka import KafkaConsumer, TopicPartition
from kafka.structs import OffsetAndMetadata

from trainer.window import PartitionRange, Window


class KafkaRewardLog:
    def __init__(self, consumer: KafkaConsumer, topic: str, read_timeout_s: float = 60.0) -> None:
        """``consumer``: in the trainer's consumer group, ``read_committed``, auto-commit off."""
        self.topic = topic
        self.read_timeout_s = read_timeout_s
        self.consumer = consumer

    def _partitions(self) -> list[TopicPartition]:
        deadline = time.monotonic() + 30
        while True:
            parts = self.consumer.partitions_for_topic(self.topic)
            if parts:
                return [TopicPartition(self.topic, p) for p in sorted(parts)]
            if time.monotonic() > deadline:
                raise RuntimeError(f"rewards topic {self.topic!r} does not exist (or has no partitions)")
            time.sleep(0.5)

    def positions(self) -> tuple[dict[int, int | None], dict[int, int], dict[int, int]]:
        tps = self._partitions()
        committed = {tp.partition: self.consumer.committed(tp) for tp in tps}
        beginnings = {tp.partition: int(o) for tp, o in self.consumer.beginning_offsets(tps).items()}
        ends = {tp.partition: int(o) for tp, o in self.consumer.end_offsets(tps).items()}
        return committed, beginnings, ends

    def read(self, window: Window) -> Iterator[tuple[int, int, bytes]]:
        todo = {TopicPartition(self.topic, r.partition): r for r in window.ranges if r.end > r.start}
        if not todo:
            return
        self.consumer.assign(list(todo))
        for tp, r in todo.items():
            self.consumer.seek(tp, r.start)
        deadline = time.monotonic() + self.read_timeout_s
        while todo:
            batch = self.consumer.poll(timeout_ms=500)
            yield from _in_ranges(batch, todo)
            for tp in list(todo):
                if self.consumer.position(tp) >= todo[tp].end:
                    del todo[tp]
            if batch:
                deadline = time.monotonic() + self.read_timeout_s
            elif time.monotonic() > deadline:
                left = sorted(t.partition for t in todo)
                raise TimeoutError(f"no progress reading window {window.id} of {self.topic} "
                                   f"for {self.read_timeout_s}s (partitions left: {left})")
        self.consumer.assign([])

    def commit(self, window: Window) -> None:
        offsets = {
            TopicPartition(self.topic, r.partition): OffsetAndMetadata(r.end, f"window {window.id}", -1)
            for r in window.ranges
        }
        self.consumer.commit(offsets)

    def close(self) -> None:
        self.consumer.close()


def _in_ranges(batch: Mapping[TopicPartition, Sequence[Any]], todo: Mapping[TopicPartition, PartitionRange]
               ) -> Iterator[tuple[int, int, bytes]]:
    """(partition, offset, value) of the polled records that fall inside their range."""
    for tp, records in batch.items():
        r = todo.get(tp)
        if r is None:
            continue
        for rec in records:
            if r.start <= rec.offset < r.end and rec.value is not None:
                yield tp.partition, rec.offset, rec.value
