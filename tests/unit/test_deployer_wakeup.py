"""The deployer's wait between ticks ends early when a writer bumps ``deployer:wake`` or an
operator command is queued, and keeps the schedule otherwise (also when Redis fails)."""

from __future__ import annotations

import time

import fakeredis
import redis

from deployer.adapters.redis_state import Wakeup, wake_deployer
from ingest.contracts.keys import deployer_commands_key

P = "t:"


class Clock:
    """A fake ``sleep`` for ``Wakeup.wait`` that runs ``at[k]`` before the k-th sleep returns."""

    def __init__(self, at: dict[int, object] | None = None, stop_after: int | None = None) -> None:
        self.at = at or {}
        self.slept: list[float] = []
        self.stop_after = stop_after

    def __call__(self, seconds: float) -> bool:
        time.sleep(seconds)
        self.slept.append(seconds)
        action = self.at.get(len(self.slept))
        if callable(action):
            action()
        return self.stop_after is not None and len(self.slept) >= self.stop_after


def test_a_bump_ends_the_wait_with_its_reason_once() -> None:
    r = fakeredis.FakeRedis()
    wake_deployer(r, P, "an older bump, before the deployer started")
    w = Wakeup(r, P, poll_s=0.0001)
    clock = Clock(at={3: lambda: wake_deployer(r, P, "candidate v7 registered")})
    assert w.wait(60.0, clock) == "candidate v7 registered"
    assert len(clock.slept) == 3
    # seen once: the next wait runs its whole tick (here: until the stopper says stop)
    assert w.wait(60.0, Clock(stop_after=5)) is None


def test_every_replica_sees_the_same_bump() -> None:
    r = fakeredis.FakeRedis()
    a, b = Wakeup(r, P, poll_s=0.0001), Wakeup(r, P, poll_s=0.0001)
    wake_deployer(r, P, "candidate v3 registered")
    assert a.wait(60.0, Clock()) == b.wait(60.0, Clock()) == "candidate v3 registered"


def test_a_queued_operator_command_ends_the_wait() -> None:
    r = fakeredis.FakeRedis()
    w = Wakeup(r, P, poll_s=0.0001)
    assert w.wait(60.0, Clock(at={2: lambda: r.rpush(deployer_commands_key(P), b"{}")})) == "operator command"


def test_without_a_wake_up_the_tick_runs_its_course() -> None:
    r = fakeredis.FakeRedis()
    w = Wakeup(r, P, poll_s=0.01)
    clock = Clock()
    assert w.wait(0.05, clock) is None
    assert 4 <= len(clock.slept) <= 6 and all(s <= 0.01 for s in clock.slept)
    assert sum(clock.slept) <= 0.05 + 1e-9


class Broken(fakeredis.FakeRedis):
    def pipeline(self, *a: object, **k: object) -> object:
        raise redis.ConnectionError("down")

    def hget(self, *a: object, **k: object) -> object:
        raise redis.ConnectionError("down")


def test_redis_down_keeps_the_schedule_and_waking_is_best_effort() -> None:
    r = Broken()
    wake_deployer(r, P, "lost")  # no exception: the deployer ticks on its schedule
    w = Wakeup(r, P, poll_s=0.01)
    assert w.wait(0.03, Clock()) is None
