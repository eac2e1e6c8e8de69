"""Watching the running loop: every few seconds, which services exited, who is champion,
what the deployer decided, and a progress line with the live cohort metrics per arm.

:func:`watch` is the demo's main loop: it looks, lets the bad candidate in when the loop is
ready for it, and ends once enough canaries were decided or the time budget is spent.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import redis

from ingest.adapters.redis_json import read_json
from ingest.contracts.keys import deployer_status_key, routing_key
from services.demo.chaos import Chaos
from services.demo.config import STOP_RESERVE_S, DemoPlan
from services.demo.console import say
from services.demo.inject import BadCandidates
from services.demo.services import Live
from services.report.cohorts import Cohort
from services.report.sources import Decision, read_ledger
from services.settings.demo import DemoSettings
from services.settings.model import Settings

LEDGER_EVERY_S = 10.0
"""How often the ledger in MLflow is read for new decisions."""
RECENT_S = 60.0
"""The window of the progress line's live cohort metrics."""
TRAINER_STOP_GRACE_S = 60.0
"""How long the trainer has to exit on SIGTERM before the holdout measurement (after the loop):
one idle at the end of seed 10's loop took more than 20 s and was killed."""


def read_routing(client: redis.Redis, prefix: str) -> dict[str, str]:
    """The gateway's routing keys in Redis (canary weight, stable and canary versions)."""
    names = ("canary_weight", "stable_version", "canary_version")
    try:
        vals = client.mget([routing_key(prefix, n) for n in names])
    except Exception:
        return {}
    return {n: (v.decode() if isinstance(v, bytes) else str(v)) for n, v in zip(names, vals, strict=True)
            if v is not None}


def read_deployer_status(client: redis.Redis, prefix: str) -> dict[str, Any]:
    """The deployer's persisted status ({} when there is none or Redis does not answer)."""
    try:
        return read_json(client, deployer_status_key(prefix)) or {}
    except Exception:
        return {}


def read_decisions(settings: Settings) -> list[Decision]:
    """The ledger's decided canaries, oldest first (none when MLflow cannot be read)."""
    try:
        return read_ledger(settings.mlflow.tracking_uri, settings.mlflow.deployments_experiment)
    except Exception:
        return []


def progress_line(elapsed: float, champion: str | None, status: Mapping[str, Any],
                  routing: Mapping[str, str], recent: Mapping[tuple[str, str], Cohort],
                  decided: Mapping[str, str], rewards: int) -> str:
    """``m:ss phase=… champion=v… candidate=v… @w% | <arm> v<version>: … | decided: … | rewards=n``."""
    phase = status.get("phase", "?")
    champion = champion or routing.get("stable_version") or "?"
    cand = status.get("candidate") or routing.get("canary_version")
    weight = float(routing.get("canary_weight") or status.get("weight") or 0.0)
    head = f"{int(elapsed // 60)}:{int(elapsed % 60):02d} phase={phase} champion=v{champion}"
    if cand:
        head += f" candidate=v{cand} @{weight:.0%}"
    parts = [head]
    for (version, arm), c in sorted(recent.items()):
        if c.n < 5:
            continue
        parts.append(f"{arm} v{version}: n={c.n} persist={_f(c.edit_persistence)} "
                     f"lat={_f(c.latency_ms, '.0f')}ms reward={_f(c.reward)} "
                     f"edits={_f(c.edit_rate, '.0%')}")
    if decided:
        parts.append("decided: " + ", ".join(f"v{v} {o}" for v, o in decided.items()))
    parts.append(f"rewards={rewards}")
    return " | ".join(parts)


def _f(x: float, fmt: str = ".2f") -> str:
    return "-" if isinstance(x, float) and math.isnan(x) else format(x, fmt)


@dataclass
class Watcher:
    """What the demo has seen of the loop so far."""

    live: Live
    started: float
    notes: list[str]
    """The report's notes: a service that exits is noted there."""
    decided: dict[str, str] = field(default_factory=dict)
    """Version -> outcome of every canary in the ledger, in the order they were seen."""
    champion: str | None = None
    last_ledger: float = 0.0

    def look(self) -> dict[str, Any]:
        """One look at the loop (says the progress line); returns the deployer's status."""
        self._report_exits()
        prefix = self.live.settings.redis.key_prefix
        status = read_deployer_status(self.live.redis, prefix)
        routing = read_routing(self.live.redis, prefix)
        try:
            self.champion = self.live.registry().alias_version("champion")
        except Exception:
            self.champion = None
        if time.time() - self.last_ledger > LEDGER_EVERY_S:
            self._read_ledger()
            self.last_ledger = time.time()
        tracker = self.live.tracker
        say(progress_line(time.time() - self.started, self.champion, status, routing,
                          tracker.recent(RECENT_S), self.decided, tracker.count()))
        return status

    def _report_exits(self) -> None:
        supervisor = self.live.supervisor
        for name, rc in supervisor.newly_exited().items():
            say(f"service {name} exited with code {rc}; last lines of its log:\n{supervisor.log_tail(name)}")
            self.notes.append(f"Service {name} exited during the run with code {rc}.")

    def _read_ledger(self) -> None:
        for d in read_decisions(self.live.settings):
            if d.candidate not in self.decided:
                self.decided[d.candidate] = d.outcome
                say(f"DECISION: v{d.candidate} {d.outcome} by {d.decided_by}: {d.reason}")


def watch(plan: DemoPlan, live: Live, bad: BadCandidates, notes: list[str],
          chaos: Chaos | None = None) -> None:
    """Look at the loop every ``progress_every_s`` until enough canaries were decided (and the
    bad candidate's), or the budget less STOP_RESERVE_S is spent; then measure the last
    champion against the holdout (:func:`measure_holdout`)."""
    demo = plan.demo
    if "simulator" not in live.supervisor.procs or "gateway" not in live.supervisor.procs:
        say("the loop needs the gateway and the simulator; stopping")
        return
    deadline = plan.loop_deadline(time.time())
    what = "promoted" if demo.until_promoted else "decided"
    whose = (f"the rest of the {demo.minutes:g}-minute budget less {STOP_RESERVE_S:g} s to stop"
             if demo.minutes is not None else "its own budget, --loop-minutes")
    say(f"loop running for at most {max(0.0, deadline - time.time()) / 60:.1f} min ({whose}) or "
        f"{demo.increments} {what} increments (plus the bad candidate)")
    if time.time() >= deadline:
        say(f"the stack start and the bootstrap used the whole {demo.minutes:g}-minute budget; "
            "no time is left for the loop (raise --minutes, or leave it out: the loop then has its own)")
        notes.append("The loop did not run: the stack start and the bootstrap used the whole time budget.")
        return
    watcher = Watcher(live, plan.started, notes)
    while time.time() < deadline:
        time.sleep(demo.progress_every_s)
        if chaos is not None:
            chaos.step()
        status = watcher.look()
        bad.step(status, watcher.decided, live.tracker.count())
        if increments_decided(watcher.decided, bad.tries, demo.until_promoted) >= demo.increments \
                and bad.done(watcher.decided):
            say("enough canaries decided; finishing")
            break
    else:
        say("the loop's time is up; finishing")
    measure_holdout(plan, deadline, watcher, chaos)


def holdout_until(demo: DemoSettings, deadline: float, now: float) -> float | None:
    """When the last champion's measurement against the holdout ends, the loop having ended at
    ``now`` (None: no measurement). Its length is fixed by the settings, never by what was
    seen; it follows the loop's own minutes, and ends with a whole-run budget (``minutes``)."""
    length = demo.holdout_measure_seconds()
    if demo.holdout_share <= 0 or length <= 0:
        return None
    until = now + length
    if demo.minutes is not None:
        until = min(until, deadline)
    return until if until > now else None


def measure_holdout(plan: DemoPlan, deadline: float, watcher: Watcher, chaos: Chaos | None) -> None:
    """With a holdout, stop the trainer (no new candidate from here) and serve
    :func:`holdout_until` more, so that the last champion is measured against the holdout in the
    same minutes. A canary already running goes on and may still be decided."""
    until = holdout_until(plan.demo, deadline, time.time())
    if until is None:
        return
    supervisor = watcher.live.supervisor
    if "trainer" in supervisor.procs:
        supervisor.stop("trainer", grace_s=TRAINER_STOP_GRACE_S)
        supervisor.reported_exit.add("trainer")  # stopped on purpose: not an exit to report
    say(f"trainer stopped; measuring the last champion against the holdout for "
        f"{max(0.0, until - time.time()):.0f}s (fixed before the run)")
    while time.time() < until:
        time.sleep(min(plan.demo.progress_every_s, max(0.0, until - time.time())))
        if chaos is not None:
            chaos.step()
        watcher.look()


def increments_decided(decided: Mapping[str, str], bad_tries: list[str], until_promoted: bool) -> int:
    """The trainer's increments decided so far (only the promoted ones with ``until_promoted``)."""
    return len([v for v, outcome in decided.items() if v not in bad_tries
                and (outcome == "promoted" or not until_promoted)])
