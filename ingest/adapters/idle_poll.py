"""Polling that costs (almost) nothing while a topic is quiet.

A consumer's ``poll(timeout_ms=T)`` keeps sending fetch requests until a record arrives or
``T`` passes. A broker that holds an empty fetch for ``fetch.max.wait.ms`` (Apache Kafka)
makes that a cheap wait; a broker that answers an empty fetch at once (the embedded broker
does) makes it a spin: about 500 fetches/s and a whole core per idle consumer. The loops
here therefore stop waiting inside the client once a poll came back empty: they wait on
their own clock (10 ms, doubling up to ``idle_ms``), then poll with ``timeout_ms=0``, which
takes what the fetch sent by the previous poll brought. On either broker an idle consumer
then sends about ``1000 / idle_ms`` fetches per second, and a record that ends a quiet spell
waits at most ``idle_ms`` longer than it would have.

A loop with timers (the reward join's window closes) tells the poller when the next one is
due (:meth:`IdlePoller.wake_at`): no wait runs past it, so a timer fires on time however
long the waits have grown, and while nothing at all is pending the waits may grow to a
longer ``quiet_ms``.
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

log = logging.getLogger(__name__)

FIRST_IDLE_WAIT_S = 0.01
"""The first wait after an empty poll; each further empty poll doubles it up to the cap."""


class Pollable(Protocol):
    """What :class:`IdlePoller` needs of a consumer (kafka-python's ``KafkaConsumer``)."""

    def poll(self, timeout_ms: int = 0, max_records: int | None = None) -> Mapping[Any, Sequence[Any]]: ...


def next_idle_wait(previous_s: float, cap_s: float, first_s: float = FIRST_IDLE_WAIT_S) -> float:
    """The wait before the next poll after an empty one: ``first_s``, then doubling, at most
    ``cap_s`` (0 when the cap is 0: never wait)."""
    if cap_s <= 0:
        return 0.0
    return min(cap_s, max(first_s, previous_s * 2))


class IdlePoller:
    """``poll`` for a long-running loop: non-blocking polls, and after an empty one a wait on
    ``wait`` (e.g. a stopper's, so shutdown stays prompt) of 10 ms doubling up to ``idle_ms``.

    With ``quiet_ms`` (longer than ``idle_ms``) the waits grow on up to it while the loop has
    said that nothing is pending (``wake_at(None)``); a timer it announces (``wake_at(t)``,
    ``t`` on ``clock``) caps the waits at ``idle_ms`` and ends the wait that reaches ``t``.

    A group member that has to (re)join its group polls with ``join_timeout_ms`` instead:
    joining takes broker round trips that a non-blocking poll never waits for."""

    def __init__(self, consumer: Pollable, idle_ms: int, join_timeout_ms: int = 500,
                 wait: Callable[[float], object] = time.sleep, quiet_ms: int | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.consumer = consumer
        self.idle_s = max(0, idle_ms) / 1000.0
        """The longest wait between two polls of a quiet topic while a timer is pending."""
        self.quiet_s = max(self.idle_s, (quiet_ms or 0) / 1000.0)
        """The longest wait while nothing is pending."""
        self.join_timeout_ms = join_timeout_ms
        self.wait = wait
        self.clock = clock
        self.waiting_s = 0.0
        """The current wait (0: the last poll brought records)."""
        self.timer: float | None = None
        """When the loop's next timer is due, on ``clock`` (None: nothing pending)."""

    def poll(self, max_records: int | None = None) -> Mapping[Any, Sequence[Any]]:
        wait_s = self.waiting_s
        if self.timer is not None:
            wait_s = min(wait_s, max(0.0, self.timer - self.clock()))
        if wait_s > 0:
            self.wait(wait_s)
        timeout_ms = self.join_timeout_ms if joining(self.consumer) else 0
        try:
            got = self.consumer.poll(timeout_ms=timeout_ms, max_records=max_records)
        except struct.error as exc:
            rejoin_after_bad_assignment(self.consumer, exc)
            self.busy()  # the next poll goes on with the join
            return {}
        if any(got.values()):
            self.waiting_s = 0.0
        else:
            self.waiting_s = next_idle_wait(self.waiting_s, self.idle_s if self.timer is not None
                                            else self.quiet_s)
        return got

    def wake_at(self, at: float | None) -> None:
        """The loop's next timer is due at ``at`` on ``clock`` (None: nothing is pending)."""
        self.timer = at
        if at is not None:
            self.waiting_s = min(self.waiting_s, self.idle_s)

    def busy(self) -> None:
        """Poll without waiting next time (e.g. after a rebalance or an error)."""
        self.waiting_s = 0.0


def joining(consumer: Any) -> bool:
    """Whether a group member has no partitions yet or its group coordinator asks it to
    rejoin (kafka-python 3.0's coordinator; a consumer without one, e.g. one that assigns
    its partitions itself, never joins)."""
    coordinator = getattr(consumer, "_coordinator", None)
    if coordinator is None or getattr(coordinator, "group_id", None) is None:
        return False
    if not consumer.assignment():
        return True
    need_rejoin = getattr(coordinator, "need_rejoin", None)
    unknown = getattr(coordinator, "coordinator_unknown", None)
    return bool((need_rejoin is not None and need_rejoin()) or (unknown is not None and unknown()))


def rejoin_after_bad_assignment(consumer: Any, exc: Exception) -> None:
    """kafka-python 3.0.12 cannot decode an empty partition assignment: its ``poll`` raises
    ``struct.error`` out of the group join and leaves the member marked stable with no
    partitions (seen on the embedded broker while members joined and left during a
    rebalance; Apache Kafka also sends empty bytes to a member the leader left out). The
    member asks its coordinator for a new join instead of stopping the process; re-raises
    when the consumer has no group coordinator to ask."""
    coordinator = getattr(consumer, "_coordinator", None)
    request_rejoin = getattr(coordinator, "request_rejoin", None)
    if request_rejoin is None:
        raise exc
    log.warning("the group's partition assignment could not be decoded (%s); rejoining the group", exc)
    request_rejoin()
