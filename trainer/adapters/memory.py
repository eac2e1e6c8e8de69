"""In-memory fakes of the trainer's ports, beside their real adapters (unit tier only)."""

from __future__ import annotations

from collections.abc import Iterator

from trainer.window import Window


class InMemoryRewardLog:
    """The fake rewards topic: a list of values per partition. Unit tests only."""

    def __init__(self, topic: str, partitions: int = 2) -> None:
        self.topic = topic
        self.data: dict[int, list[bytes]] = {p: [] for p in range(partitions)}
        self.cut: dict[int, int | None] = {p: None for p in range(partitions)}

    def append(self, partition: int, value: bytes) -> None:
        self.data[partition].append(value)

    def positions(self) -> tuple[dict[int, int | None], dict[int, int], dict[int, int]]:
        return dict(self.cut), {p: 0 for p in self.data}, {p: len(v) for p, v in self.data.items()}

    def read(self, window: Window) -> Iterator[tuple[int, int, bytes]]:
        for r in window.ranges:
            for off in range(r.start, r.end):
                yield r.partition, off, self.data[r.partition][off]

    def commit(self, window: Window) -> None:
        self.cut.update(window.ends())
