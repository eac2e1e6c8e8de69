"""``rtrl demo --chaos``: kill a random service now and then, restart it, and prove at the end
that nothing was lost or duplicated and that every decided canary has one complete record.

Every ``every_s`` seconds :class:`Chaos` picks one running service among ingest, reward,
trainer, deployer and gateway, kills its whole process group with SIGKILL (no chance to
flush or commit: a crash, not a shutdown) and starts it again at once. The loop must go on:
ingest and the reward worker resume from their committed offsets (exactly once), the
trainer resumes its increment from its checkpoint, a new deployer takes the lease once the
dead one's expires and continues the canary from its persisted status, and the gateway
reloads its models (its users see errors meanwhile; the served events its workers had
spooled but not yet shipped are delivered by the restarted gateway's shipper).

At the end (services stopped, consumers drained) :func:`verify` runs ``rtrl reconcile`` on
the topics and reads the ledger: 0 lost and 0 duplicated events and rewards, no raw event
left unprocessed (a worker that never recovered from a kill shows up here), and exactly one
closed ledger run per decided canary.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from services.demo.console import say
from services.stack.supervisor import ProcSpec, Supervisor, serve_argv

CHAOS_SERVICES = ("ingest", "reward", "trainer", "deployer", "gateway")


@dataclass(frozen=True)
class Kill:
    at: float
    service: str
    pid: int


class Chaos:
    def __init__(self, supervisor: Supervisor, every_s: float, seed: int,
                 services: Sequence[str] = CHAOS_SERVICES, clock: Callable[[], float] = time.time) -> None:
        if every_s <= 0:
            raise ValueError("chaos interval must be positive")
        self.supervisor, self.every_s, self.services, self.clock = supervisor, every_s, tuple(services), clock
        self.rng = random.Random(seed)
        self.next_at = clock() + every_s
        self.kills: list[Kill] = []

    def step(self) -> Kill | None:
        """Kill and restart one running service when one is due; the kill, or None."""
        now = self.clock()
        if now < self.next_at:
            return None
        self.next_at = now + self.every_s
        procs = self.supervisor.procs
        running = [s for s in self.services if s in procs and procs[s].poll() is None]
        if not running:
            return None
        victim = self.rng.choice(running)
        proc = procs[victim]
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the service and its children (Ray, exposures)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)
        self.supervisor.start(ProcSpec(victim, serve_argv(victim)))
        kill = Kill(now, victim, proc.pid)
        self.kills.append(kill)
        say(f"CHAOS: killed {victim} (pid {proc.pid}) with SIGKILL and restarted it "
            f"(kill {len(self.kills)}; next in {self.every_s:g}s)")
        return kill


@dataclass
class ChaosResult:
    kills: list[Kill] = field(default_factory=list)
    reconcile: dict[str, Any] = field(default_factory=dict)
    """``rtrl reconcile --json``'s report (empty when it could not run)."""
    reconcile_error: str = ""
    canaries: int = 0
    complete: int = 0
    in_flight: list[str] = field(default_factory=list)
    """Canaries still running when the demo stopped (not decided: no record expected)."""
    duplicated_records: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        rec = self.reconcile
        return (not self.reconcile_error and rec.get("lost") == 0 and rec.get("duplicated") == 0
                and rec.get("raw_pending") == 0
                and not self.duplicated_records and self.complete == self.canaries)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ok"] = self.ok
        return out

    def line(self) -> str:
        rec = self.reconcile
        return (f"chaos: {len(self.kills)} kills ({', '.join(k.service for k in self.kills) or 'none'}); "
                f"reconcile: {rec.get('lost', '?')} lost, {rec.get('duplicated', '?')} duplicated, "
                f"{rec.get('raw_pending', '?')} raw events never processed"
                f"{' (' + self.reconcile_error + ')' if self.reconcile_error else ''}; ledger: "
                f"{self.complete}/{self.canaries} decided canaries with one complete record, "
                f"{len(self.duplicated_records)} duplicated, {len(self.in_flight)} in flight at stop"
                f" -> {'OK' if self.ok else 'FAILED'}")


def ledger_check(runs: Sequence[Mapping[str, str]]) -> tuple[int, int, list[str], list[str]]:
    """(decided canaries, complete records, in flight, duplicated) from the ledger runs' tags:
    a decided canary has exactly one run, and that run names its decision and who made it."""
    by_id: dict[str, list[Mapping[str, str]]] = {}
    for tags in runs:
        by_id.setdefault(tags.get("rtrl.canary.id", ""), []).append(tags)
    decided = complete = 0
    in_flight, duplicated = [], []
    for cid, group in sorted(by_id.items()):
        outcomes = {t.get("rtrl.canary.outcome", "") for t in group}
        if outcomes <= {"", "running"}:
            in_flight.append(cid)
            continue
        decided += 1
        if len(group) > 1:
            duplicated.append(cid)
            continue
        tags = group[0]
        if all(tags.get(k) for k in ("rtrl.decision", "rtrl.decision.reason", "rtrl.decided_by")):
            complete += 1
    return decided, complete, in_flight, duplicated


def read_ledger_tags(tracking_uri: str, experiment: str) -> list[dict[str, str]]:
    from mlflow import MlflowClient  # slow to import: only at the end

    client = MlflowClient(tracking_uri=tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    return [dict(r.data.tags) for r in client.search_runs([exp.experiment_id], max_results=1000)]


def run_reconcile(env: Mapping[str, str], timeout_s: float = 300.0) -> tuple[dict[str, Any], str]:
    """``rtrl reconcile --json`` against the demo's stack: (report, error)."""
    proc = subprocess.run([sys.executable, "-m", "services.cli", "reconcile", "--json"],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout_s)
    try:
        return json.loads(proc.stdout), ""
    except ValueError:
        return {}, f"reconcile exited {proc.returncode}: {(proc.stderr or proc.stdout)[-300:]}"


def verify(chaos: Chaos, env: Mapping[str, str], tracking_uri: str, experiment: str) -> ChaosResult:
    result = ChaosResult(kills=list(chaos.kills))
    result.reconcile, result.reconcile_error = run_reconcile(env)
    try:
        runs = read_ledger_tags(tracking_uri, experiment)
    except Exception as exc:
        result.reconcile_error = result.reconcile_error or f"ledger unreadable: {exc}"
        runs = []
    result.canaries, result.complete, result.in_flight, result.duplicated_records = ledger_check(runs)
    return result
