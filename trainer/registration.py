"""The increment's calls to the registry and the run tracker: the register step and the run's
bookkeeping, retried after training and never duplicated.

The calls after training (step metrics, register, offer, close the run) are retried with a
bounded backoff, up to ``registry_retry_s`` per call (:class:`Retrying`), so a registry
outage shorter than that costs a wait, not the training. Before registering again after a
failed attempt the window's version is looked up first (the failed attempt may have
registered it), so a window never gets two versions (:func:`register_candidate`). An outage
outlasting the budget fails the increment with the window pending, and the next run
registers it.

A version that passed the gate is offered as the ``candidate`` (:func:`offer`), unless a
canary is in flight or the offer lock cannot be taken. The tracking run is closed as
FINISHED (:func:`close_run`) or FAILED (:func:`mark_failed`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol, TypeVar

from deployer.ledger import clip
from deployer.records import window_words
from deployer.registry import LockUnavailableError, Registry, manifest_tags, offer_candidate
from ingest.contracts.registry import NOTE, RUN_BAND_STOP, RUN_OUTCOME, RUN_RESUMED_BY, RUN_VERSION, Tag
from trainer.gate import GateResult, gate_words
from trainer.trust_region import stop_name

log = logging.getLogger("trainer.increment")  # one logger for every step of the increment
T = TypeVar("T")


class RunTracker(Protocol):
    """Experiment tracking: one run per increment (MLflow in production)."""

    def start(self, name: str, params: dict[str, str], tags: dict[str, str]) -> str:
        """Open a run; return its id."""
        ...

    def log_steps(self, run_id: str, history: Sequence[dict[str, float]]) -> None:
        """Metrics over steps."""
        ...

    def finish(self, run_id: str, status: str, metrics: dict[str, float], tags: dict[str, str]) -> None:
        """Final metrics and tags; status FINISHED, FAILED or KILLED."""
        ...

    def open_runs(self, name: str) -> list[str]:
        """The ids of the runs named ``name`` that are still open (RUNNING)."""
        ...

    def log_text(self, run_id: str, text: str, name: str) -> None:
        """A text file as an artifact of the run."""
        ...


class Retrying:
    """Calls a registry operation until it succeeds or ``budget_s`` has passed since its
    first failure (backoff 1 s, doubling, at most 15 s). ``failures`` counts failed attempts
    of every operation; ``on_retry`` is told about each one that will be retried."""

    def __init__(self, budget_s: float, on_retry: Callable[[BaseException], None] | None = None,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.budget_s, self.on_retry, self.sleep = budget_s, on_retry, sleep
        self.failures = 0

    def __call__(self, what: str, fn: Callable[[], T]) -> T:
        deadline: float | None = None
        pause = 1.0
        while True:
            try:
                return fn()
            except Exception as exc:
                self.failures += 1
                now = time.monotonic()
                deadline = now + self.budget_s if deadline is None else deadline
                if now >= deadline:
                    log.error("registry: could not %s within %.0fs: %s", what, self.budget_s, exc)
                    raise
                log.warning("registry: could not %s (%s: %s); retrying in %.0fs", what,
                            type(exc).__name__, str(exc)[:200], min(pause, deadline - now))
                if self.on_retry is not None:
                    self.on_retry(exc)
                self.sleep(min(pause, deadline - now))
                pause = min(15.0, pause * 2)


def registered_window_version(registry: Registry, window_id: str, look_back: int = 20) -> str | None:
    """The version (among the newest ``look_back``) trained on window ``window_id``."""
    for version in reversed(registry.versions()[-look_back:]):
        raw = registry.get_tags(version).get(Tag.WINDOW)
        if raw and json.loads(raw).get("id") == window_id:
            return version
    return None


def register_candidate(
    registry: Registry, retrying: Retrying, run_id: str, window_id: str, policy_dir: Path,
    tags: Mapping[str, str],
) -> str:
    """Register the candidate trained on window ``window_id`` and return its version. After
    any failed registry call of this increment, the window's version is looked up before
    registering again: the failed attempt may have registered it already. The version is also
    tagged with what the saved policy is (:func:`manifest_tags`)."""
    tags = {**manifest_tags(policy_dir), **tags}

    def register_once() -> str:
        if retrying.failures:
            done = registered_window_version(registry, window_id)
            if done is not None:
                return done
        return registry.register(run_id, policy_dir, tags)

    return retrying("register the candidate", register_once)


def offer(registry: Registry, version: str, lock: AbstractContextManager[object] | None) -> None:
    """Offer a version that passed the gate as the candidate. A canary in flight keeps the
    alias (moving it would abort that canary), and so does a lock that cannot be taken: a
    later increment offers a fresher candidate either way."""
    try:
        held = offer_candidate(registry, version, lock)
    except LockUnavailableError as exc:
        log.warning("version %s passed the gate but was not offered as candidate: %s", version, exc)
        return
    if held is not None:
        log.info("version %s passed the gate but v%s is still under canary: the candidate "
                 "alias stays; a later increment offers a fresher candidate", version, held)


def success_note(parent: str, window_json: str, version: str, gate: GateResult) -> str:
    """A successful increment's run description: what it was trained from and on, what it
    registered, and the offline gate against the parent in words."""
    return "\n".join([
        f"Increment of v{parent}: trained on {window_words(window_json)}; registered as v{version}"
        f"{'' if gate.passed else ', not offered (the gate failed)'}.", "", *gate_words(gate, parent)]) + "\n"


def close_run(runs: RunTracker, retrying: Retrying, run_id: str, version: str, gate: GateResult,
              stats: dict[str, float], timings: dict[str, float], note: str = "") -> None:
    """Final metrics and tags of a successful increment. Not being able to write them does not
    fail the increment: the version is registered and its window committed."""
    metrics = {**stats, **{f"gate_{k}": v for k, v in gate.figures.items()}, **timings}
    tags = {RUN_OUTCOME: "success", RUN_VERSION: version, Tag.GATE_RESULT: gate.result,
            **({NOTE: clip(note)} if note else {})}
    if "band_stop" in stats:
        tags[RUN_BAND_STOP] = stop_name(stats["band_stop"])
    try:
        retrying("close the training run", lambda: runs.finish(run_id, "FINISHED", metrics, tags))
    except Exception:  # registered and committed: the increment did its work
        log.exception("version %s is registered and its window committed, but run %s was not closed",
                      version, run_id)


def mark_failed(runs: RunTracker, run_id: str) -> None:
    """Close the run as FAILED. When that fails too (the registry may be what failed), log it:
    the caller re-raises the original error."""
    try:
        runs.finish(run_id, "FAILED", {}, {RUN_OUTCOME: "failed", NOTE: FAILED_NOTE})
    except Exception as exc:
        log.warning("could not mark run %s failed: %s: %s", run_id, type(exc).__name__, exc)


SPEC_ARTIFACT = "reward_spec.toml"
"""The reward spec file on an increment's run: what its rewards meant."""
SKIPPED_NOTE = "**Skipped:** {reason}. Nothing was trained; the records wait for the next increment."
FAILED_NOTE = ("**Failed.** The increment stopped on an error (the trainer's log has it); nothing was "
               "registered. Its window stays pending and the next run trains it again.")
INTERRUPTED_NOTE = ("**Interrupted.** The trainer stopped (or died) before this increment finished, so "
                    "nothing was registered from it. Its window was trained again by run {run_id}.")


def close_interrupted(runs: RunTracker, name: str, resumed_by: str) -> list[str]:
    """Close the runs of an increment whose trainer stopped before it finished (they stay
    RUNNING otherwise) as KILLED with outcome ``interrupted``, pointing at the run that trains
    their window again. Best effort: the closed ids, or none when the tracker cannot be read."""
    try:
        stale = [r for r in runs.open_runs(name) if r != resumed_by]
        for run_id in stale:
            runs.finish(run_id, "KILLED", {}, {RUN_OUTCOME: "interrupted", RUN_RESUMED_BY: resumed_by,
                                               NOTE: INTERRUPTED_NOTE.format(run_id=resumed_by)})
    except Exception as exc:
        log.warning("could not close the interrupted runs of %s: %s: %s", name, type(exc).__name__, exc)
        return []
    if stale:
        log.info("closed %d interrupted run(s) of %s as KILLED: %s", len(stale), name, ", ".join(stale))
    return stale
