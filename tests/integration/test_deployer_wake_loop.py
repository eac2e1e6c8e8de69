"""A new candidate reaches its canary within seconds at a 30 s tick: the service loop on real
Redis and MLflow, woken the way the trainer wakes it; without the wake-up it waits its tick."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from deployer_helpers import deployer_settings, register_versions

from deployer.adapters.redis_state import Wakeup, wake_deployer
from deployer.controller import Ports
from deployer.status import CanaryStatus, Phase
from services.settings.model import Settings
from services.wiring.deployer import build_controller, build_ports, reward_reader, serve_loop

TICK_S = 30.0


@pytest.fixture
def deploy(settings: Settings, mlflow_uri: str) -> Iterator[Settings]:
    yield deployer_settings(settings, mlflow_uri, tick_s=TICK_S, lease_ttl_s=3 * TICK_S)


def run_loop(deploy: Settings, statuses: list[CanaryStatus]
             ) -> tuple[threading.Event, threading.Thread, Ports]:
    ports = build_ports(deploy)
    controller = build_controller(deploy, ports, reward_reader(deploy))
    stop = threading.Event()
    wakeup = Wakeup(ports.state.r, deploy.redis.key_prefix)
    loop = threading.Thread(target=serve_loop, daemon=True, args=(controller, wakeup, TICK_S, stop.wait),
                            kwargs={"ticked": lambda s: statuses.append(s) if s is not None else None})
    loop.start()
    return stop, loop, ports


def wait_for(statuses: list[CanaryStatus], phase: Phase, timeout_s: float) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if statuses and statuses[-1].phase == phase:
            return time.monotonic() - t0
        time.sleep(0.05)
    return None


def test_a_woken_deployer_starts_the_canary_within_seconds(deploy: Settings, tmp_path: Path) -> None:
    reg = register_versions(deploy, tmp_path)
    reg.delete_alias("candidate")
    statuses: list[CanaryStatus] = []
    stop, loop, ports = run_loop(deploy, statuses)
    try:
        assert wait_for(statuses, Phase.IDLE, 30) is not None  # the first tick: nothing to do
        reg.set_alias("candidate", "2")
        # not woken: the next tick is 30 s away
        assert wait_for(statuses, Phase.PENDING, 3.0) is None
        wake_deployer(ports.state.r, deploy.redis.key_prefix, "candidate v2 registered")
        # woken: pending at once, and the pending canary ticks again after a second
        took = wait_for(statuses, Phase.PROGRESSING, 15.0)
        assert took is not None, [s.phase for s in statuses]
        assert statuses[-1].weight == deploy.deployer.steps[0]
    finally:
        stop.set()
        loop.join(timeout=TICK_S + 10)
    assert not loop.is_alive(), "the loop did not stop within a tick of the stopper"
