"""``rtrl demo --chaos``: the kill schedule on real (sleeping) processes and the end checks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.demo import chaos as demo_chaos
from services.demo.chaos import Chaos, ChaosResult, ledger_check
from services.stack.supervisor import ProcSpec, Supervisor

pytestmark = pytest.mark.unit

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


def test_a_due_kill_sigkills_one_running_service_and_restarts_it(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo_chaos, "serve_argv", lambda _name: SLEEP)
    sup = Supervisor(tmp_path)
    for name in ("ingest", "reward", "simulator"):
        sup.start(ProcSpec(name, SLEEP))
    now = [1000.0]
    chaos = Chaos(sup, every_s=30, seed=1, clock=lambda: now[0])
    try:
        assert chaos.step() is None  # not due yet
        now[0] += 30
        before = {n: p.pid for n, p in sup.procs.items()}
        kill = chaos.step()
        assert kill is not None and kill.service in {"ingest", "reward"}  # never the simulator
        old = subprocess.Popen  # the killed process is gone and a new one runs under its name
        assert isinstance(sup.procs[kill.service], old)
        assert sup.procs[kill.service].pid != before[kill.service]
        assert sup.procs[kill.service].poll() is None
        assert sup.procs["simulator"].pid == before["simulator"]
        assert chaos.step() is None and chaos.next_at == now[0] + 30
    finally:
        sup.stop_all(grace_s=1)


def test_the_schedule_is_reproducible_from_the_seed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo_chaos, "serve_argv", lambda _name: SLEEP)
    victims = []
    for _ in range(2):
        sup = Supervisor(tmp_path)
        for name in demo_chaos.CHAOS_SERVICES:
            sup.start(ProcSpec(name, SLEEP))
        ticks = iter(float(t) for t in range(100))
        chaos = Chaos(sup, every_s=1, seed=7, clock=ticks.__next__)
        try:
            for _ in range(3):
                chaos.step()
        finally:
            sup.stop_all(grace_s=1)
        victims.append([k.service for k in chaos.kills])
    assert victims[0] == victims[1] and len(victims[0]) == 3


def closed(cid: str, outcome: str = "promoted") -> dict[str, str]:
    return {"rtrl.canary.id": cid, "rtrl.canary.outcome": outcome, "rtrl.decision": "promote",
            "rtrl.decision.reason": "judge", "rtrl.decided_by": "controller"}


def test_ledger_check_counts_complete_in_flight_and_duplicated_records() -> None:
    running = {"rtrl.canary.id": "c", "rtrl.canary.outcome": "running"}
    runs = [closed("a"), closed("b", "rolled_back"), running, closed("d"), closed("d"),
            {**closed("e"), "rtrl.decided_by": ""}]
    decided, complete, in_flight, duplicated = ledger_check(runs)
    assert (decided, complete, in_flight, duplicated) == (4, 2, ["c"], ["d"])


def test_a_chaos_run_is_ok_only_with_nothing_lost_duplicated_or_incomplete() -> None:
    clean = {"lost": 0, "duplicated": 0, "raw_pending": 0}
    good = ChaosResult(reconcile=clean, canaries=3, complete=3)
    assert good.ok and "OK" in good.line()
    assert not ChaosResult(reconcile={"lost": 1, "duplicated": 0}, canaries=1, complete=1).ok
    assert not ChaosResult(reconcile=clean, canaries=2, complete=1).ok
    assert not ChaosResult(reconcile={}, reconcile_error="broker down").ok
    stalled = {"lost": 0, "duplicated": 0, "raw_pending": 9}  # a worker that never came back
    assert not ChaosResult(reconcile=stalled, canaries=1, complete=1).ok
    assert not ChaosResult(reconcile=clean, duplicated_records=["x"]).ok
