"""Consumer-group lag from the broker's offsets (deployer/adapters/group_lag.py): the maths
against a plain reference, and the monitor's metrics and failure handling with a fake reader."""

from __future__ import annotations

import random

import pytest

from deployer.adapters.group_lag import (
    GroupLag,
    GroupLagMonitor,
    HeadCache,
    PartitionLag,
    known_heads,
    partition_lags,
    summarise,
)
from ingest.contracts import prometheus as m

pytestmark = pytest.mark.unit


def _reference(committed: dict[int, int], starts: dict[int, int], ends: dict[int, int],
               head: dict[int, float], now: float) -> list[tuple[int, int, float]]:
    rows = []
    for p in sorted(ends):
        first = starts.get(p, 0)
        if p in committed and committed[p] > first:
            first = committed[p]
        n = ends[p] - first if ends[p] > first else 0
        age = now - head[p] if (n > 0 and p in head and now > head[p]) else 0.0
        rows.append((p, n, age))
    return rows


def test_partition_lags_match_a_plain_reference_on_random_offsets() -> None:
    rng = random.Random(5)
    for _ in range(500):
        parts = rng.randint(1, 6)
        starts = {p: rng.randint(0, 50) for p in range(parts)}
        ends = {p: starts[p] + rng.randint(0, 100) for p in range(parts)}
        committed = {p: rng.randint(0, ends[p]) for p in range(parts) if rng.random() < 0.7}
        head = {p: rng.uniform(900.0, 1100.0) for p in range(parts) if rng.random() < 0.8}
        got = partition_lags(committed, starts, ends, head, now=1000.0)
        assert [(x.partition, x.messages, x.seconds) for x in got] == _reference(
            committed, starts, ends, head, 1000.0)


def test_a_group_that_never_committed_counts_from_the_first_retained_record() -> None:
    got = partition_lags({}, {0: 40}, {0: 100}, {0: 10.0}, now=70.0)
    assert got == [PartitionLag(0, 60, 60.0)]


def test_records_removed_by_retention_are_not_counted() -> None:
    assert partition_lags({0: 5}, {0: 40}, {0: 100}, {}, now=70.0) == [PartitionLag(0, 60, 0.0)]


def test_no_backlog_has_age_zero_whatever_the_last_records_age() -> None:
    assert partition_lags({0: 100}, {0: 0}, {0: 100}, {0: 1.0}, now=5000.0) == [PartitionLag(0, 0, 0.0)]


def test_the_group_sums_messages_and_takes_the_oldest_wait() -> None:
    lags = [PartitionLag(0, 3, 12.5), PartitionLag(1, 0, 0.0), PartitionLag(2, 7, 40.0)]
    assert summarise("g", "t", lags) == GroupLag("g", "t", 10, 40.0)
    assert summarise("g", "t", []) == GroupLag("g", "t", 0, 0.0)


class _Reader:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.closed = False

    def group_lag(self, group: str, topic: str, now: float) -> GroupLag:
        if self.fail:
            raise ConnectionError("broker down")
        return GroupLag(group, topic, 42, 17.0)

    def close(self) -> None:
        self.closed = True


def test_the_monitor_exports_each_groups_lag() -> None:
    mon = GroupLagMonitor("deployer", [("g-ingest", "raw"), ("g-reward", "events")],
                          lambda: _Reader(), clock=lambda: 1234.0)  # type: ignore[arg-type,return-value]
    assert mon.tick()
    reg = m.registry_for("deployer")
    for group, topic in (("g-ingest", "raw"), ("g-reward", "events")):
        labels = {"group": group, "topic": topic}
        assert reg.get_sample_value("rtrl_group_lag_messages", labels) == 42
        assert reg.get_sample_value("rtrl_group_lag_seconds", labels) == 17.0
    assert reg.get_sample_value("rtrl_group_lag_read_timestamp_seconds") == 1234.0


def test_a_failed_read_is_counted_and_the_next_one_reconnects() -> None:
    readers: list[_Reader] = []

    def connect() -> _Reader:
        readers.append(_Reader(fail=len(readers) == 0))
        return readers[-1]

    before = m.DEPENDENCY_RETRIES.labels("deployer", "kafka")._value.get()
    mon = GroupLagMonitor("deployer", [("g", "t")], connect)  # type: ignore[arg-type]
    assert not mon.tick()
    assert m.DEPENDENCY_RETRIES.labels("deployer", "kafka")._value.get() == before + 1
    assert readers[0].closed
    assert mon.tick()
    assert len(readers) == 2


class _Heads:
    """A head reader that answers from ``ts`` (offset -> timestamp) unless told to time out."""

    def __init__(self, ts: dict[int, dict[int, float]]) -> None:
        self.ts = ts
        self.first: dict[int, int] = {}
        self.timeout: set[int] = set()
        self.reads: list[list[int]] = []

    def __call__(self, parts: list[int]) -> dict[int, float]:
        self.reads.append(parts)
        return {p: self.ts[p][self.first[p]] for p in parts if p not in self.timeout}


def test_a_stalled_groups_age_keeps_growing_when_head_reads_time_out() -> None:
    heads = _Heads({0: {5: 100.0, 9: 300.0}, 1: {2: 50.0}})
    cache: HeadCache = {}
    heads.first = {0: 5, 1: 2}
    got = known_heads(cache, "g", "t", heads.first, [0, 1], heads)
    assert got == {0: 100.0, 1: 50.0} and heads.reads == [[0, 1]]
    # nothing moved: the same records, no read at all
    assert known_heads(cache, "g", "t", heads.first, [0, 1], heads) == {0: 100.0, 1: 50.0}
    assert heads.reads == [[0, 1]]
    # partition 0 moved on and its read times out: the older head stays (an upper bound), never none
    heads.first = {0: 9, 1: 2}
    heads.timeout = {0}
    assert known_heads(cache, "g", "t", heads.first, [0, 1], heads) == {0: 100.0, 1: 50.0}
    lags = partition_lags({0: 9, 1: 2}, {0: 0, 1: 0}, {0: 20, 1: 10},
                          known_heads(cache, "g", "t", heads.first, [0, 1], heads), now=1000.0)
    assert [x.seconds for x in lags] == [900.0, 950.0]
    # the next read that answers replaces it with the true head
    heads.timeout = set()
    assert known_heads(cache, "g", "t", heads.first, [0, 1], heads)[0] == 300.0
    # a partition whose backlog is gone is forgotten; another group's heads are its own
    assert known_heads(cache, "g", "t", heads.first, [1], heads) == {1: 50.0}
    assert ("g", "t", 0) not in cache and ("g", "t", 1) in cache
    assert known_heads(cache, "other", "t", {1: 2}, [1], heads) == {1: 50.0}
    assert ("other", "t", 1) in cache


def test_a_head_never_read_has_no_age_yet_without_a_clock() -> None:
    heads = _Heads({0: {3: 10.0}})
    heads.first, heads.timeout = {0: 3}, {0}
    assert known_heads({}, "g", "t", heads.first, [0], heads) == {}


def test_a_head_whose_first_read_times_out_ages_from_when_the_backlog_was_seen() -> None:
    # the first read of a partition's head times out (a busy machine): its age is not 0 but
    # grows from the tick the backlog was first seen, until a read answers with the true head
    heads = _Heads({0: {3: 10.0, 8: 400.0}})
    heads.first, heads.timeout = {0: 3}, {0}
    cache: HeadCache = {}
    ages = []
    for now in (100.0, 130.0, 160.0):
        got = known_heads(cache, "g", "t", heads.first, [0], heads, now)
        ages.append(partition_lags({0: 3}, {0: 0}, {0: 50}, got, now)[0].seconds)
    assert ages == [0.0, 30.0, 60.0], "a lower bound that keeps growing, never reset to 0"
    assert len(heads.reads) == 3, "an unread head is read again every tick"
    heads.timeout = set()
    assert known_heads(cache, "g", "t", heads.first, [0], heads, 190.0) == {0: 10.0}
    assert cache[("g", "t", 0)] == (3, 10.0, True)
    # the group moves on and the new head cannot be read: the exact older head bounds it above
    heads.first, heads.timeout = {0: 8}, {0}
    assert known_heads(cache, "g", "t", heads.first, [0], heads, 220.0) == {0: 10.0}
    # the backlog gone, the partition is forgotten; a new one starts from when it is seen
    assert known_heads(cache, "g", "t", heads.first, [], heads, 250.0) == {}
    assert known_heads(cache, "g", "t", heads.first, [0], heads, 280.0) == {0: 280.0}
