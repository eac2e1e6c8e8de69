"""Readiness: required checks take a process out of its Service, advisory ones only say so."""

from __future__ import annotations

import time

from services.runtime.health import Health


def test_a_failing_advisory_check_is_degraded_not_unready() -> None:
    h = Health()
    state = {"model": True, "broker": False}
    h.add_check("champion_loaded", lambda: state["model"])
    h.add_check("broker", lambda: state["broker"], required=False)
    ok, body = h.ready()
    assert ok and body["failing"] == [] and body["degraded"] == ["broker"]
    assert body["checks"] == ["broker", "champion_loaded"]
    state["model"] = False
    ok, body = h.ready()
    assert not ok and body["failing"] == ["champion_loaded"] and body["degraded"] == ["broker"]
    state.update(model=True, broker=True)
    assert h.ready() == (True, {"failing": [], "checks": ["broker", "champion_loaded"]})


def test_a_check_that_raises_fails_and_required_is_the_default() -> None:
    h = Health()

    def boom() -> bool:
        raise ConnectionError("redis down")

    h.add_check("redis", boom)
    assert h.ready() == (False, {"failing": ["redis"], "checks": ["redis"]})


def test_a_process_with_two_loops_is_live_only_while_both_tick() -> None:
    h = Health(liveness_timeout_s=0.05)
    h.beat()
    h.beat("sessions_")
    assert h.live()[0]
    time.sleep(0.08)
    h.beat()  # the first loop ticks, the second is stuck
    assert not h.live()[0]
    h.beat("sessions_")
    assert h.live()[0]
