"""Data windows: which reward records an increment trains on, each exactly once.

A window is a set of offset ranges ``[start, end)`` on the rewards topic, one per partition:

- ``start`` is the *cut* of the last successful increment, kept as the committed offsets of
  the trainer's consumer group (``trainer.consumer_group``, default ``rtrl-trainer``); with
  no committed offset, the partition's beginning;
- ``end`` is the watermark taken when the increment is triggered: the partition's end offset
  read under ``read_committed`` (the last stable offset), so every record below it is a
  closed reward whose transaction committed — rewards are complete up to there.

The window is written to a *pending* file before training. A failed or killed increment
leaves it there, and the retry trains the very same window (same offsets, same Ray run name,
so Ray Train resumes from the last checkpoint). Only after the candidate is registered are
the ends committed as the new cut and the pending file removed. A window too small to train
on is skipped and not committed: its records wait for the next increment.

:class:`RewardLog` is the port over the topic; ``trainer/adapters/kafka_rewards.py`` is the
Kafka adapter and ``InMemoryRewardLog`` (trainer/adapters/memory.py) the fake.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Protocol

from pydantic import ValidationError

from ingest.events import RewardRecord


@dataclass(frozen=True)
class PartitionRange:
    partition: int
    start: int
    """First offset in the window."""
    end: int
    """First offset after the window (the watermark)."""


@dataclass(frozen=True)
class Window:
    topic: str
    ranges: tuple[PartitionRange, ...]
    records: int = 0
    """Valid reward records read (set after reading)."""
    invalid: int = 0
    """Records that did not parse as RewardRecord (counted, skipped)."""
    heldout: int = 0
    """Records kept out of training for the gate."""

    @property
    def id(self) -> str:
        """Stable identity of the offsets (not the counts): names the Ray run of a retry."""
        key = json.dumps([self.topic, [(r.partition, r.start, r.end) for r in self.ranges]])
        return hashlib.sha256(key.encode()).hexdigest()[:12]

    @property
    def offsets(self) -> int:
        """Offsets spanned (>= records: transaction markers occupy offsets too)."""
        return sum(r.end - r.start for r in self.ranges)

    def ends(self) -> dict[int, int]:
        return {r.partition: r.end for r in self.ranges}

    def starts(self) -> dict[int, int]:
        return {r.partition: r.start for r in self.ranges}

    def to_json(self) -> str:
        """What the ``rtrl.window`` tag and the pending file hold."""
        body = asdict(self)
        body["id"] = self.id
        return json.dumps(body, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Window:
        body = json.loads(text)
        body.pop("id", None)
        body["ranges"] = tuple(PartitionRange(**r) for r in body["ranges"])
        return cls(**body)

    def with_counts(self, records: int, invalid: int, heldout: int) -> Window:
        return replace(self, records=records, invalid=invalid, heldout=heldout)


class RewardLog(Protocol):
    """The rewards topic as the trainer sees it."""

    def positions(self) -> tuple[dict[int, int | None], dict[int, int], dict[int, int]]:
        """Per partition: the committed cut (None when never committed), the beginning
        offset and the end offset (watermark) now."""
        ...

    def read(self, window: Window) -> Iterator[tuple[int, int, bytes]]:
        """Yield ``(partition, offset, value)`` for every record in the window's ranges."""
        ...

    def commit(self, window: Window) -> None:
        """Store the window's ends as the new cut (called once the candidate is registered)."""
        ...


def plan_window(
    topic: str,
    committed: Mapping[int, int | None],
    beginnings: Mapping[int, int],
    ends: Mapping[int, int],
    max_offsets: int | None = None,
) -> Window:
    """The window from the cut (or the beginning) to the watermark on every partition.
    ``max_offsets`` caps the span, shared evenly between partitions."""
    parts = sorted(ends)
    per_part = None if max_offsets is None or not parts else max(1, -(-max_offsets // len(parts)))
    ranges = []
    for p in parts:
        cut = committed.get(p)
        start = max(cut if cut is not None else 0, beginnings.get(p, 0))
        end = max(start, ends[p])
        if per_part is not None:
            end = min(end, start + per_part)
        ranges.append(PartitionRange(p, start, end))
    return Window(topic, tuple(ranges))


def resume_or_plan(
    topic: str,
    log: RewardLog,
    pending: Window | None,
    max_offsets: int | None = None,
) -> tuple[Window, bool]:
    """The window to train now and whether it is a retry of the pending one.

    A pending window is retried when it starts at the current cut (its increment failed);
    one that starts elsewhere is stale (the cut moved on) and a new window is planned."""
    committed, beginnings, ends = log.positions()
    if pending is not None and pending.topic == topic:
        cut = {p: max(c if c is not None else 0, beginnings.get(p, 0)) for p, c in committed.items()}
        if all(cut.get(r.partition, 0) == r.start for r in pending.ranges):
            return pending, True
    return plan_window(topic, committed, beginnings, ends, max_offsets), False


@dataclass
class ParsedWindow:
    train: list[RewardRecord] = field(default_factory=list)
    heldout: list[RewardRecord] = field(default_factory=list)
    invalid: int = 0
    excluded: int = 0
    """Valid records left out of training by :func:`keep_served_by`."""


def parse_records(
    values: Iterable[bytes], heldout_fraction: float, salt: str = "rtrl-heldout"
) -> ParsedWindow:
    """Parse reward records; split train / held-out by a hash of ``request_id`` (stable
    across retries). Records that do not validate are counted and skipped."""
    out = ParsedWindow()
    for raw in values:
        try:
            rec = RewardRecord.model_validate_json(raw)
        except ValidationError:
            out.invalid += 1
            continue
        if len(rec.behavior_logprobs) != len(rec.completion_tokens):
            out.invalid += 1
            continue
        (out.heldout if is_heldout(rec.request_id, heldout_fraction, salt) else out.train).append(rec)
    return out


def keep_served_by(parsed: ParsedWindow, keep: Callable[[str], bool]) -> ParsedWindow:
    """Drop the records served by a version ``keep`` rejects (by ``model.version``), from both
    splits, counting them in ``excluded``."""
    train = [r for r in parsed.train if keep(r.model.version)]
    heldout = [r for r in parsed.heldout if keep(r.model.version)]
    dropped = len(parsed.train) + len(parsed.heldout) - len(train) - len(heldout)
    return ParsedWindow(train, heldout, parsed.invalid, parsed.excluded + dropped)


def is_heldout(request_id: str, fraction: float, salt: str = "rtrl-heldout") -> bool:
    if fraction <= 0:
        return False
    h = int.from_bytes(hashlib.sha256(f"{salt}:{request_id}".encode()).digest()[:8], "big")
    return h / 2**64 < fraction


def skip_reason(window: Window, n_train: int, min_records: int) -> str | None:
    """Why this window should not be trained on, or None."""
    if window.offsets == 0:
        return "no new reward records since the last increment"
    if n_train < min_records:
        return (
            f"too few records: {n_train} training records (< min_records={min_records}); "
            "they stay for the next increment"
        )
    return None


class PendingWindow:
    """The window being trained, in a JSON file (written atomically)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def load(self) -> Window | None:
        if not self.path.exists():
            return None
        return Window.from_json(self.path.read_text())

    def save(self, window: Window) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(window.to_json())
        os.replace(tmp, self.path)

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)
