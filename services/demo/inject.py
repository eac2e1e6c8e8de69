"""The demo's deliberately bad candidate: built from the champion, registered like an
increment, and offered as ``candidate`` once the loop is ready for it; the deployer must then
roll it back by itself.

It is offered through the same locked check-and-set as the trainer's increments
(:func:`deployer.registry.offer_candidate`): it waits while another canary is pending or in
flight, and an increment finishing meanwhile leaves it in place. One whose canary is aborted
before a verdict (say by an operator) is replaced by a new version, up to MAX_BAD_TRIES.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from deployer.registry import LockUnavailableError, Registry, manifest_tags, offer_candidate
from ingest.contracts.registry import Tag
from services.demo.console import say
from services.settings.demo import DemoSettings
from services.sim.agent import AgentWorld
from services.sim.users import World

MAX_BAD_TRIES = 3
BASELINE_REWARDS = 150
"""Reward records to collect before the bad candidate goes in (the stable cohort's baseline)."""
QUIET_PHASES = frozenset({"idle", "succeeded", "rolled_back", "aborted", None})
"""Deployer phases in which no canary is running (None: the deployer has said nothing yet)."""


BuildBad = Callable[[str, Path, Path, World | AgentWorld, int], Path]
"""(kind, champion's policy directory, output directory, world, seed) -> the bad policy's directory."""


def _make_bad_candidate(kind: str, champion_dir: Path, out_dir: Path, world: World | AgentWorld,
                        seed: int) -> Path:
    from services.demo.candidates import make_bad_candidate  # imports torch

    return make_bad_candidate(kind, champion_dir, out_dir, world, seed)


def ready_for_bad(demo: DemoSettings, decided: Mapping[str, str], status: Mapping[str, Any],
                  rewards: int) -> bool:
    """Whether the loop is ready for the bad candidate: enough canaries decided, none running,
    and a baseline of rewards from the champion."""
    if len(decided) < demo.bad_candidate_after_decisions:
        return False
    if status and status.get("phase") not in QUIET_PHASES:
        return False
    return rewards >= BASELINE_REWARDS


class BadCandidateInjector:
    """Registers and offers the bad candidate; :meth:`step` once per look at the loop."""

    def __init__(self, demo: DemoSettings, work_dir: Path, world: World | AgentWorld,
                 registry: Callable[[], Registry], lock: AbstractContextManager[object],
                 build: BuildBad | None = None, wake: Callable[[str], None] | None = None,
                 kind: str | None = None) -> None:
        self.demo = demo
        self.kind = kind or demo.bad_candidate
        """What bad candidate this injector makes (a :data:`services.demo.candidates.KINDS`)."""
        self.work_dir = work_dir
        """Where the champion is downloaded and the bad policy written (wiped per try)."""
        self.world = world
        self.registry = registry
        self.lock = lock
        """The lock of the ``candidate`` alias every writer of it holds."""
        self.build = build
        """Makes the bad policy; None: :func:`services.demo.candidates.make_bad_candidate`."""
        self.wake = wake or (lambda _reason: None)
        """Tells the deployer to tick now (deployer/adapters/redis_state.py: wake_deployer)."""
        self.version: str | None = None
        """The bad candidate of the current try (None: not registered yet)."""
        self.offered = False
        """Whether ``version`` holds the candidate alias (it waits while another canary runs)."""
        self.tries: list[str] = []
        """Every bad candidate registered, in order."""

    def step(self, status: Mapping[str, Any], decided: Mapping[str, str], rewards: int) -> None:
        """Register the bad candidate once the loop is ready for it, then offer it until it
        holds the alias (``decided``: version -> outcome of the ledger so far)."""
        if self.kind == "none" or not self._wants_offer(decided):
            return
        if not ready_for_bad(self.demo, decided, status, rewards):
            return
        if self.version is None:
            self.version = self.register()
            if self.version is None:
                return
        self._offer(self.version)

    def done(self, decided: Mapping[str, str]) -> bool:
        """Whether the bad candidate needs nothing more: none asked for, decided by a verdict,
        or the last allowed try decided."""
        if self.kind == "none":
            return True
        if self.version is not None and decided.get(self.version) not in {None, "aborted"}:
            return True
        return len(self.tries) >= MAX_BAD_TRIES and self.tries[-1] in decided

    def kinds(self) -> dict[str, str]:
        """Version -> kind of every bad candidate registered (for the report)."""
        return {v: self.kind for v in self.tries}

    def _wants_offer(self, decided: Mapping[str, str]) -> bool:
        """Whether there is something to register or offer; starts a new try when the current
        candidate was aborted before a verdict (and tries are left)."""
        if self.version is None:
            return True
        if decided.get(self.version) != "aborted":
            return not self.offered
        if len(self.tries) >= MAX_BAD_TRIES:
            return False
        say(f"bad candidate v{self.version} was aborted before a verdict (see its reason); "
            "injecting another one")
        self.version, self.offered = None, False
        return True

    def _offer(self, version: str) -> None:
        try:
            held = offer_candidate(self.registry(), version, self.lock)
        except LockUnavailableError as exc:
            say(f"could not offer bad candidate v{version} yet: {exc}")
            return
        if held is not None:
            say(f"bad candidate v{version} waits: v{held} holds the candidate alias")
            return
        self.offered = True
        self.wake(f"bad candidate v{version} offered")
        say(f"bad candidate v{version} ({self.kind}) now holds the candidate alias")

    def register(self) -> str | None:
        """Build the bad policy from the current champion and register it (no alias yet)."""
        demo, reg = self.demo, self.registry()
        champion = reg.alias_version("champion")
        if champion is None:
            return None
        say(f"building the deliberately bad candidate ({self.kind}) from champion v{champion} ...")
        shutil.rmtree(self.work_dir, ignore_errors=True)
        src = reg.download(champion, self.work_dir / "champion")
        out = (self.build or _make_bad_candidate)(self.kind, Path(src), self.work_dir / "policy",
                                                  self.world, demo.seed)
        version = str(reg.register(None, out, {
            Tag.KIND: self.kind,
            Tag.PARENT_VERSION: champion,
            Tag.GATE_RESULT: "pass",
            Tag.GATE_REASONS: json.dumps(["injected by rtrl demo: skips the offline gate so the live "
                                          "canary must catch it"]),
            **manifest_tags(out),
        }))
        self.tries.append(version)
        say(f"bad candidate v{version} registered")
        return version


def bad_kinds(demo: DemoSettings) -> tuple[str, ...]:
    """The bad candidates a run injects, in order: under ``--agent`` the default is both of
    the agent's (a malformed-tool one, then a stalling one); otherwise the one named."""
    if demo.agent and demo.bad_candidate == "reward-hacked":
        return ("malformed-tool", "stalling")
    return (demo.bad_candidate,)


class BadCandidates:
    """Several bad candidates, one after the other: the next is built and offered once the
    one before it needs nothing more (:meth:`BadCandidateInjector.done`)."""

    def __init__(self, injectors: Sequence[BadCandidateInjector]) -> None:
        if not injectors:
            raise ValueError("at least one bad candidate injector is needed")
        self.injectors = list(injectors)

    def _current(self, decided: Mapping[str, str]) -> BadCandidateInjector | None:
        return next((i for i in self.injectors if not i.done(decided)), None)

    def step(self, status: Mapping[str, Any], decided: Mapping[str, str], rewards: int) -> None:
        current = self._current(decided)
        if current is not None:
            current.step(status, decided, rewards)

    def done(self, decided: Mapping[str, str]) -> bool:
        return self._current(decided) is None

    @property
    def tries(self) -> list[str]:
        return [v for i in self.injectors for v in i.tries]

    @property
    def version(self) -> str | None:
        """The latest bad candidate registered."""
        return self.tries[-1] if self.tries else None

    def kinds(self) -> dict[str, str]:
        return {v: k for i in self.injectors for v, k in i.kinds().items()}
