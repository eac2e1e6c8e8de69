"""Polling a quiet topic: waits between non-blocking polls, a blocking poll to (re)join."""

from __future__ import annotations

import struct
from typing import Any

import pytest

from ingest.adapters.idle_poll import IdlePoller, joining, next_idle_wait


def reference_waits(cap_s: float, n: int, first_s: float = 0.01) -> list[float]:
    out, w = [], 0.0
    for _ in range(n):
        w = first_s if w == 0 else w * 2
        w = min(w, cap_s)
        out.append(w)
    return out


@pytest.mark.parametrize("cap", [0.005, 0.01, 0.2, 0.5, 3.0])
def test_waits_double_from_10ms_up_to_the_cap(cap: float) -> None:
    got, w = [], 0.0
    for _ in range(12):
        w = next_idle_wait(w, cap)
        got.append(w)
    assert got == pytest.approx(reference_waits(cap, 12))


def test_a_zero_cap_never_waits() -> None:
    assert next_idle_wait(0.0, 0.0) == 0.0
    assert next_idle_wait(0.4, 0.0) == 0.0


class FakeConsumer:
    def __init__(self, batches: list[dict[str, list[int]]]) -> None:
        self.batches = batches
        self.timeouts: list[int] = []

    def poll(self, timeout_ms: int = 0, max_records: int | None = None) -> dict[str, list[int]]:
        self.timeouts.append(timeout_ms)
        return self.batches.pop(0) if self.batches else {}


def test_a_quiet_topic_is_polled_without_blocking_and_with_growing_waits() -> None:
    empty: dict[str, list[int]] = {"p0": []}
    consumer = FakeConsumer([{"p0": [1, 2]}, empty, empty, empty, {"p0": [3]}, empty])
    waits: list[float] = []
    poller = IdlePoller(consumer, idle_ms=25, wait=waits.append)
    got = [sum(len(v) for v in poller.poll(10).values()) for _ in range(6)]
    assert got == [2, 0, 0, 0, 1, 0]
    assert consumer.timeouts == [0] * 6  # a consumer without a group never blocks
    # no wait after records; 10 ms, 20 ms, then the 25 ms cap; records reset it
    assert waits == pytest.approx([0.01, 0.02, 0.025])


def test_busy_drops_the_wait() -> None:
    consumer = FakeConsumer([])
    waits: list[float] = []
    poller = IdlePoller(consumer, idle_ms=1000, wait=waits.append)
    poller.poll()
    poller.poll()
    poller.busy()
    poller.poll()
    assert waits == pytest.approx([0.01])


class Coordinator:
    def __init__(self, group_id: str | None, rejoin: bool = False, unknown: bool = False) -> None:
        self.group_id = group_id
        self.rejoin = rejoin
        self.unknown = unknown

    def need_rejoin(self) -> bool:
        return self.rejoin

    def coordinator_unknown(self) -> bool:
        return self.unknown


class GroupConsumer(FakeConsumer):
    def __init__(self, coordinator: Coordinator, assigned: set[Any]) -> None:
        super().__init__([])
        self._coordinator = coordinator
        self.assigned = assigned

    def assignment(self) -> set[Any]:
        return self.assigned


@pytest.mark.parametrize(("coordinator", "assigned", "expected"), [
    (Coordinator("g"), set(), True),                 # not a member yet
    (Coordinator("g", rejoin=True), {"p0"}, True),   # a rebalance asks it to rejoin
    (Coordinator("g", unknown=True), {"p0"}, True),  # the coordinator moved
    (Coordinator("g"), {"p0"}, False),               # a stable member
    (Coordinator(None), set(), False),               # assigns its partitions itself
])
def test_a_member_that_must_join_blocks_so_the_join_completes(
        coordinator: Coordinator, assigned: set[Any], expected: bool) -> None:
    consumer = GroupConsumer(coordinator, assigned)
    assert joining(consumer) is expected
    IdlePoller(consumer, idle_ms=100, join_timeout_ms=321, wait=lambda _s: None).poll()
    assert consumer.timeouts == [321 if expected else 0]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def test_with_nothing_pending_the_waits_grow_to_the_quiet_cap() -> None:
    clock = Clock()
    waits: list[float] = []
    poller = IdlePoller(FakeConsumer([]), idle_ms=40, quiet_ms=300, clock=clock,
                        wait=lambda s: (waits.append(s), clock.sleep(s)))
    for _ in range(8):
        poller.poll()
        poller.wake_at(None)
    assert waits == pytest.approx(reference_waits(0.3, 7))


def test_a_pending_timer_caps_the_waits_and_ends_the_wait_that_reaches_it() -> None:
    clock = Clock()
    waits: list[float] = []
    poller = IdlePoller(FakeConsumer([]), idle_ms=200, quiet_ms=5000, clock=clock,
                        wait=lambda s: (waits.append(s), clock.sleep(s)))
    for _ in range(10):  # grown to the quiet cap: 10 ms ... 2.56 s
        poller.poll()
        poller.wake_at(None)
    assert waits[-1] == pytest.approx(2.56)
    timer = clock.t + 0.05
    poller.wake_at(timer)  # a window opened: its close is due in 50 ms
    poller.poll()
    assert waits[-1] == pytest.approx(0.05) and clock.t == pytest.approx(timer)
    poller.wake_at(clock.t + 10.0)  # the next close is far: poll every idle_ms meanwhile
    for _ in range(3):
        poller.poll()
    assert waits[-3:] == pytest.approx([0.2, 0.2, 0.2])


def test_a_timer_already_due_is_not_waited_for() -> None:
    clock = Clock()
    waits: list[float] = []
    consumer = FakeConsumer([])
    poller = IdlePoller(consumer, idle_ms=200, clock=clock, wait=waits.append)
    poller.poll()
    poller.wake_at(clock.t - 1.0)  # more windows are due than one batch closed
    poller.poll()
    assert waits == [] and len(consumer.timeouts) == 2


def test_a_quiet_cap_below_the_idle_cap_acts_as_the_idle_cap() -> None:
    poller = IdlePoller(FakeConsumer([]), idle_ms=500, quiet_ms=100)
    assert poller.quiet_s == poller.idle_s == 0.5


class Rejoinable(Coordinator):
    def __init__(self) -> None:
        super().__init__("g")
        self.requested = 0

    def request_rejoin(self) -> None:
        self.requested += 1


class BadAssignment(GroupConsumer):
    """kafka-python 3.0.12 decoding an empty SyncGroup assignment inside ``poll``."""

    def poll(self, timeout_ms: int = 0, max_records: int | None = None) -> dict[str, list[int]]:
        return struct.unpack(">h", b"")  # type: ignore[return-value]


def test_an_undecodable_assignment_asks_for_a_rejoin_and_polls_again_at_once() -> None:
    coordinator = Rejoinable()
    waits: list[float] = []
    poller = IdlePoller(BadAssignment(coordinator, set()), idle_ms=100, wait=waits.append)
    assert poller.poll() == {}
    assert poller.poll() == {}
    assert coordinator.requested == 2
    assert waits == []  # the next poll goes on with the join instead of waiting


def test_an_undecodable_assignment_without_a_group_coordinator_is_raised() -> None:
    consumer = BadAssignment(Coordinator("g"), set())  # a coordinator that cannot rejoin
    with pytest.raises(struct.error):
        IdlePoller(consumer, idle_ms=100, wait=lambda _s: None).poll()
