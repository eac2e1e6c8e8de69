"""The closed loop under chaos, bounded for CI: ``rtrl demo --chaos`` kills a random service
(ingest, reward, trainer, deployer, gateway) with SIGKILL every ``RTRL_E2E_CHAOS_EVERY_S``
(60) seconds and restarts it. The deployer must still roll the injected bad candidate back by
itself, and at the end nothing may be lost or duplicated, no raw event left unprocessed and
every decided canary must have exactly one complete ledger record.

The run is the one test_closed_loop.py checks too (``loop_run``, tests/e2e/conftest.py): it
lasts until the loop has promoted an increment, so the kills go on through the bad
candidate's canary, an increment's training and its canary. The full-size runs are recorded
in docs/reliability.md.
"""

from __future__ import annotations

import itertools
import json

import pytest

from tests.e2e.demo_helpers import LOOP_TIMEOUT_S, LoopRun


@pytest.mark.timeout(LOOP_TIMEOUT_S)
def test_the_loop_survives_random_kills_and_loses_nothing(loop_run: LoopRun) -> None:
    proc, out, data, reports = loop_run.proc, loop_run.out, loop_run.data, loop_run.reports
    every = loop_run.every
    assert (data / "chaos.json").exists(), out[-4000:]
    chaos = json.loads((data / "chaos.json").read_text())
    rec = chaos["reconcile"]
    assert rec.get("lost") == 0 and rec.get("duplicated") == 0, rec
    assert rec.get("raw_pending") == 0, f"a worker never recovered: {rec}"
    assert rec.get("requests_served", 0) > 1000 and rec.get("reward_records", 0) > 500, rec
    assert not chaos["duplicated_records"] and chaos["complete"] == chaos["canaries"] >= 1, chaos
    killed = [k["service"] for k in chaos["kills"]]
    # the loop runs until it has promoted an increment (after the bad candidate's canary and
    # an increment's: 6 minutes or more on 2 cores): several kills of several services, and
    # chaos never stalled between them
    assert len(killed) >= 4 and len(set(killed)) >= 3, killed
    times = [k["at"] for k in chaos["kills"]]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert max(gaps) <= every + 20, f"chaos stalled: gaps {gaps}"
    assert chaos["ok"] and proc.returncode == 0, out[-4000:]

    [summary_file] = reports.glob("*/summary.json")
    summary = json.loads(summary_file.read_text())
    # --json: stdout is one document (the services' output went to stderr) naming the same
    doc = json.loads(proc.stdout)
    assert doc["exit_code"] == 0 and doc["report"] == str(summary_file.parent / "report.md")
    assert doc["chaos"]["kills"] == chaos["kills"] and doc["chaos"]["reconcile"] == rec
    assert doc["summary"]["decisions"] == summary["decisions"]
    assert doc["bad_version"] == summary["bad_version"]
    bad = summary["bad_version"]
    rolled = [d for d in summary["decisions"] if d["outcome"] == "rolled_back"
              and d["decided_by"] == "controller"]
    assert bad and any(d["candidate"] == bad for d in rolled), f"bad v{bad} not rolled back: {summary}"
