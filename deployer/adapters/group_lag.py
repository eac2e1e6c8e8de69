"""Consumer-group lag read from the broker, by a process that outlives the consumers.

A consumer exports its own lag (``rtrl_consumer_lag_messages``), so when it dies its series
vanish while the backlog grows. The deployer (one replica, always running) therefore also
reads each pipeline group's committed offsets and the partitions' ends from the broker and
exports, per group and topic, the backlog in messages and its age in seconds: how long the
oldest record not yet committed by the group has waited (``rtrl_group_lag_seconds``). An
empty backlog is 0 seconds, whatever the age of the last record.

The age needs the timestamp of each partition's first uncommitted record, read from the
broker with a deadline. A head read that times out (a busy machine) must not make a growing
backlog look fresh, so the heads read are remembered (:func:`known_heads`): a group that has
not moved since keeps its exact age without a read, one whose read timed out keeps the age of
the head last read for it (an older record: an upper bound), and one whose head was never
read counts from when its backlog was first seen (a lower bound that keeps growing), never 0.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ingest.adapters.idle_poll import IdlePoller
from ingest.contracts import prometheus as m
from kafka import TopicPartition

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PartitionLag:
    partition: int
    messages: int
    seconds: float


@dataclass(frozen=True)
class GroupLag:
    group: str
    topic: str
    messages: int
    """Records between the group's committed offsets and the partitions' ends, summed."""
    seconds: float
    """Age of the oldest uncommitted record over the partitions (0 with no backlog)."""


def partition_lags(
    committed: Mapping[int, int],
    starts: Mapping[int, int],
    ends: Mapping[int, int],
    head_ts: Mapping[int, float],
    now: float,
) -> list[PartitionLag]:
    """Lag per partition of ``ends``. A partition the group never committed counts from its
    first retained offset; a committed offset below it (records removed by retention) counts
    from there too. ``head_ts`` maps a partition to the timestamp (s) of its first
    uncommitted record; a backlog without one (not read yet) has age 0."""
    out = []
    for p in sorted(ends):
        start = max(committed.get(p, starts.get(p, 0)), starts.get(p, 0))
        messages = max(0, ends[p] - start)
        seconds = max(0.0, now - head_ts[p]) if messages and p in head_ts else 0.0
        out.append(PartitionLag(p, messages, seconds))
    return out


def summarise(group: str, topic: str, lags: list[PartitionLag]) -> GroupLag:
    return GroupLag(group, topic, sum(x.messages for x in lags), max((x.seconds for x in lags), default=0.0))


HeadCache = dict[tuple[str, str, int], tuple[int, float, bool]]
"""(group, topic, partition) -> (offset of the group's first uncommitted record, its timestamp,
exact). Not exact: the record was never read, and the timestamp is when the backlog was first
seen at that offset (the record was written before then, so its age is a lower bound)."""


def known_heads(cache: HeadCache, group: str, topic: str, first: Mapping[int, int], behind: list[int],
                read: Callable[[list[int]], Mapping[int, float]],
                now: float | None = None) -> dict[int, float]:
    """The head timestamp of each partition in ``behind`` (those with a backlog): from
    ``cache`` when the group's first uncommitted offset is the one read before (the same
    record), else from ``read``. A partition ``read`` found nothing for keeps the head last
    read for it (an older record: its age is an upper bound); one never read gets the time
    its backlog was first seen at this offset (given ``now``): a lower bound that grows while
    the group does not move, so a backlog whose head cannot be read never looks fresh. Updates
    ``cache``, and forgets the partitions without a backlog."""
    heads: dict[int, float] = {}
    to_read = []
    for p in behind:
        hit = cache.get((group, topic, p))
        if hit is not None and hit[0] == first[p] and hit[2]:
            heads[p] = hit[1]
        else:
            to_read.append(p)
    got = read(to_read) if to_read else {}
    for p in to_read:
        hit = cache.get((group, topic, p))
        if p in got:
            heads[p] = got[p]
            cache[(group, topic, p)] = (first[p], got[p], True)
        elif hit is not None and (hit[2] or hit[0] == first[p]):
            heads[p] = hit[1]  # an older record read before, or first seen at this offset
        elif now is not None:
            heads[p] = now
            cache[(group, topic, p)] = (first[p], now, False)
    for key in [k for k in cache if k[0] == group and k[1] == topic and k[2] not in behind]:
        del cache[key]
    return heads


def committed_offsets(admin: Any, group: str, topic: str) -> dict[int, int]:
    """The group's committed offset per partition of ``topic`` ({} when it has none)."""
    try:
        offs = admin.list_group_offsets(group).get(group, {}) or {}
    except Exception:  # an unknown group has no offsets
        return {}
    return {tp.partition: int(getattr(om, "offset", om)) for tp, om in offs.items()
            if getattr(tp, "topic", None) == topic and int(getattr(om, "offset", om)) >= 0}


class BrokerOffsets:
    """Reads offsets and head timestamps with kafka-python (an admin client and an
    unassigned consumer, ``group_id=None``, so reading never joins or moves a group)."""

    def __init__(self, admin: Any, consumer: Any, heads: HeadCache | None = None) -> None:
        self.admin = admin
        self.consumer = consumer
        self.heads: HeadCache = {} if heads is None else heads
        """Heads read so far (:func:`known_heads`); the monitor keeps it across reconnects."""

    def group_lag(self, group: str, topic: str, now: float) -> GroupLag:
        parts = self.consumer.partitions_for_topic(topic) or set()
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        if not tps:
            return GroupLag(group, topic, 0, 0.0)
        ends = {tp.partition: off for tp, off in self.consumer.end_offsets(tps).items()}
        starts = {tp.partition: off for tp, off in self.consumer.beginning_offsets(tps).items()}
        committed = committed_offsets(self.admin, group, topic)
        first = {p: max(committed.get(p, starts[p]), starts[p]) for p in ends}
        behind = [tp.partition for tp in tps if first[tp.partition] < ends[tp.partition]]
        heads = known_heads(self.heads, group, topic, first, behind,
                            lambda ps: self._head_ts([TopicPartition(topic, p) for p in ps], first), now)
        return summarise(group, topic, partition_lags(committed, starts, ends, heads, now))

    def _head_ts(self, tps: list[Any], first: Mapping[int, int], timeout_s: float = 2.0) -> dict[int, float]:
        """The timestamp of the record at ``first[p]`` (or the next readable one) per partition."""
        if not tps:
            return {}
        self.consumer.assign(tps)
        for tp in tps:
            self.consumer.seek(tp, first[tp.partition])
        found: dict[int, float] = {}
        deadline = time.monotonic() + timeout_s
        poller = IdlePoller(self.consumer, idle_ms=200)  # a broker answering at once: no spin
        while len(found) < len(tps) and time.monotonic() < deadline:
            for tp, records in poller.poll(max_records=100).items():
                if records and tp.partition not in found:
                    found[tp.partition] = records[0].timestamp / 1000.0
                    self.consumer.pause(tp)
        self.consumer.resume(*tps)
        return found

    def close(self) -> None:
        self.consumer.close(autocommit=False)
        self.admin.close()


class GroupLagMonitor:
    """Every ``interval_s``, reads each (group, topic) lag and sets
    ``rtrl_group_lag_messages`` and ``rtrl_group_lag_seconds``. A failed read is counted in
    ``rtrl_dependency_retries_total{dependency="kafka"}`` and leaves the last values, with
    ``rtrl_group_lag_read_timestamp_seconds`` showing their age."""

    def __init__(self, service: str, groups: list[tuple[str, str]], connect: Callable[[], BrokerOffsets],
                 interval_s: float = 30.0, clock: Callable[[], float] = time.time) -> None:
        self.service = service
        self.groups = groups
        self.connect = connect
        self.interval_s = interval_s
        self.clock = clock
        self._offsets: BrokerOffsets | None = None
        self._heads: HeadCache = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="group-lag", daemon=True)

    def read_once(self) -> list[GroupLag]:
        if self._offsets is None:
            self._offsets = self.connect()
            self._offsets.heads = self._heads
        out = []
        for group, topic in self.groups:
            lag = self._offsets.group_lag(group, topic, self.clock())
            m.GROUP_LAG_MESSAGES.labels(group, topic).set(lag.messages)
            m.GROUP_LAG_SECONDS.labels(group, topic).set(lag.seconds)
            out.append(lag)
        m.GROUP_LAG_READ.set(self.clock())
        return out

    def tick(self) -> bool:
        """One read; False (counted, connection dropped for a fresh one) when it failed."""
        try:
            self.read_once()
            return True
        except Exception as exc:  # the broker is down or the group is rebalancing: retry
            m.DEPENDENCY_RETRIES.labels(self.service, "kafka").inc()
            log.warning("reading consumer-group lag failed (%s: %s); retrying in %.0fs",
                        type(exc).__name__, str(exc)[:200], self.interval_s)
            self._drop()
            return False

    def _run(self) -> None:
        while not self._stop.is_set():
            self.tick()
            self._stop.wait(self.interval_s)
        self._drop()

    def _drop(self) -> None:
        if self._offsets is not None:
            try:
                self._offsets.close()
            except Exception:  # closing a broken client
                log.debug("closing the lag reader failed", exc_info=True)
            self._offsets = None

    def start(self) -> GroupLagMonitor:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
