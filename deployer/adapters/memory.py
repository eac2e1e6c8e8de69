"""In-memory fakes of the deployer's ports, beside their real adapters in this folder
(unit tier only)."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ingest.contracts.keys import ROUTING_FIELDS

from deployer.actions import (
    Action,
    LedgerClose,
    LedgerEvent,
    LedgerNote,
    LedgerOpen,
    LedgerRefusal,
    LedgerStep,
    apply_actions,
)
from deployer.controller import tick
from deployer.engine import FAILED, READY, EngineState
from deployer.ledger import TAG_GATE
from deployer.routing import Holdout, parse_holdout
from deployer.status import CanaryPolicy, CanaryStatus, Command, Judgement, Observations, Refusal


@dataclass
class FakeRouting:
    """The gateway's routing keys as a dict."""

    keys: dict[str, str] = field(default_factory=dict)
    writes: int = 0

    def set_routing(self, stable: str | None, canary: str | None, weight: float, salt: str) -> None:
        self.keys.update(canary_weight=repr(float(weight)), salt=salt)
        for name, version in (("stable_version", stable), ("canary_version", canary)):
            if version:
                self.keys[name] = version
            else:
                self.keys.pop(name, None)
        self.writes += 1

    def set_weight(self, weight: float) -> None:
        self.keys["canary_weight"] = repr(float(weight))
        self.writes += 1

    def set_holdout(self, holdout: Holdout | None) -> None:
        if holdout is None:
            self.keys.pop("holdout", None)
        else:
            self.keys["holdout"] = holdout.to_text()
        self.writes += 1

    def read(self) -> dict[str, str | None]:
        return {name: self.keys.get(name) for name in ROUTING_FIELDS}

    @property
    def weight(self) -> float:
        return float(self.keys.get("canary_weight", "0"))


@dataclass
class FakeAliases:
    """Aliases and version tags of one registered model."""

    aliases: dict[str, str] = field(default_factory=dict)
    tags: dict[str, dict[str, str]] = field(default_factory=dict)

    def set_alias(self, alias: str, version: str) -> None:
        self.aliases[alias] = str(version)

    def delete_alias(self, alias: str) -> None:
        self.aliases.pop(alias, None)

    def alias_version(self, alias: str) -> str | None:
        return self.aliases.get(alias)

    def set_tags(self, version: str, tags: Mapping[str, str]) -> None:
        self.tags.setdefault(str(version), {}).update(tags)

    def get_tags(self, version: str) -> dict[str, str]:
        return dict(self.tags.get(str(version), {}))


@dataclass
class FakeRun:
    params: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, dict[int, float]] = field(default_factory=dict)
    summary: dict[str, object] = field(default_factory=dict)
    closed: bool = False


@dataclass
class FakeLedger:
    """Ledger runs by canary id, with the same idempotence as the MLflow adapter."""

    runs: dict[str, FakeRun] = field(default_factory=dict)

    def record(self, event: LedgerEvent) -> None:
        run = self.runs.setdefault(event.canary_id, FakeRun())
        match event:
            case LedgerOpen():
                run.params.update(event.params)
                for k, v in event.tags.items():
                    run.tags.setdefault(k, v)
            case LedgerStep():
                for name, value in event.metrics.items():
                    run.metrics.setdefault(name, {})[event.step] = value
            case LedgerNote():
                run.tags[event.key] = event.text
            case LedgerClose():
                run.tags.update(event.tags)
                run.summary = dict(event.summary)
                run.closed = True
            case LedgerRefusal():
                run.tags.update(event.tags)
                run.closed = True


@dataclass
class FakeEngine:
    """An inference engine in memory: versions in ``bad`` fail their load or check with that
    reason; ``restart`` forgets every loaded adapter, as a real engine restart does."""

    bad: dict[str, str] = field(default_factory=dict)
    loaded: set[str] = field(default_factory=set)
    recorded: dict[str, EngineState] = field(default_factory=dict)
    calls: list[tuple[str, str]] = field(default_factory=list)

    def ensure_loaded(self, version: str) -> EngineState:
        known = self.recorded.get(version)
        if known is not None and (known.state == FAILED or known.model in self.loaded):
            return known
        self.calls.append(("load", version))
        if version in self.bad:
            st = EngineState(FAILED, self.bad[version])
        else:
            st = EngineState(READY, model=f"m-v{version}")
            self.loaded.add(st.model)
        self.recorded[version] = st
        return st

    def unload(self, version: str) -> None:
        self.calls.append(("unload", version))
        st = self.recorded.pop(version, None)
        if st is not None:
            self.loaded.discard(st.model)

    def states(self) -> dict[str, EngineState]:
        return dict(self.recorded)

    def describe(self) -> dict[str, Any]:
        return {"base_url": "memory", "engine_models": sorted(self.loaded),
                "versions": {v: {"state": s.state, "model": s.model, "reason": s.reason}
                             for v, s in self.recorded.items()}}

    def restart(self) -> None:
        self.loaded.clear()


@dataclass
class FakeWorld:
    """Registry, routing and ledger fakes driven tick by tick the way the controller does
    (decide, apply, persist as JSON, finish transient phases), recording each phase."""

    policy: CanaryPolicy = field(default_factory=CanaryPolicy)
    registry: FakeAliases = field(default_factory=FakeAliases)
    routing: FakeRouting = field(default_factory=FakeRouting)
    ledger: FakeLedger = field(default_factory=FakeLedger)
    status: CanaryStatus = field(default_factory=CanaryStatus)
    now: float = 1_800_000_000.0
    phases: list[str] = field(default_factory=list)
    engine: FakeEngine | None = None
    """An inference engine candidates are loaded into (None: local policies)."""

    def register(self, version: str, gate: str = "pass", alias: str | None = None) -> None:
        self.registry.set_tags(version, {TAG_GATE: gate})
        if alias:
            self.registry.set_alias(alias, version)

    def observe(self, judgement: Judgement | None = None, commands: tuple[Command, ...] = (),
                error: str | None = None, refused: tuple[Refusal, ...] = ()) -> Observations:
        aliases = self.registry.aliases
        versions = {aliases.get("candidate"), aliases.get("previous"),
                    *(c.version for c in commands)}
        lineage = {v: self.registry.get_tags(v) for v in versions if v}
        gate = {v: t.get(TAG_GATE, "") for v, t in lineage.items()}
        cohorts = {"stable.n": 100.0, "canary.n": 10.0} if judgement else {}
        return Observations(
            now=self.now, champion=aliases.get("champion"), candidate=aliases.get("candidate"),
            previous=aliases.get("previous"), gate=gate, lineage=lineage, judgement=judgement,
            cohorts=cohorts,
            commands=commands, refused=refused, error=error,
            holdout=parse_holdout(self.routing.keys.get("holdout"))[0],
            engine=self.engine.states() if self.engine is not None else None,
        )

    def tick(self, decision: str | None = None, dt: float = 60.0, commands: tuple[Command, ...] = (),
             error: str | None = None, refused: tuple[Refusal, ...] = (),
             plan: Mapping[str, Any] | None = None) -> CanaryStatus:
        """Advance the clock by ``dt`` and run one controller tick with this verdict (and plan)."""
        self.now += dt
        judgement = None
        if decision is not None:
            judgement = Judgement(decision, (f"judge said {decision}",),  # type: ignore[arg-type]
                                  {"reward.p_value": 0.5}, {"ticks": 1.0}, plan=dict(plan or {}))
        obs = self.observe(judgement, commands, error, refused)

        def apply(actions: list[Action]) -> None:
            apply_actions(actions, self.routing, self.registry, self.ledger, self.engine)

        def persist(status: CanaryStatus) -> None:
            self.status = CanaryStatus.from_json(json.loads(json.dumps(status.to_json())))
            self.phases.append(self.status.phase.value)

        return tick(self.status, obs, self.policy, apply, persist)


class InMemoryRegistry:
    """A registry in a dict, with policy copies in a temporary folder. Unit tests only."""

    def __init__(self, root: str | Path | None = None) -> None:
        self._root = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="rtrl-registry-"))
        self._tags: dict[str, dict[str, str]] = {}
        self._aliases: dict[str, str] = {}
        self.runs: dict[str, str | None] = {}
        """version -> run_id it was registered with."""

    def register(
        self, run_id: str | None, policy_dir: str | Path, tags: Mapping[str, str] | None = None
    ) -> str:
        src = Path(policy_dir)
        if not src.is_dir():
            raise FileNotFoundError(f"policy directory {src} does not exist")
        version = str(len(self._tags) + 1)
        shutil.copytree(src, self._root / version / "policy")
        self._tags[version] = {k: str(v) for k, v in (tags or {}).items()}
        self.runs[version] = run_id
        return version

    def _check(self, version: str) -> str:
        version = str(version)
        if version not in self._tags:
            raise KeyError(f"no version {version} in the registry")
        return version

    def set_alias(self, alias: str, version: str) -> None:
        self._aliases[alias] = self._check(version)

    def delete_alias(self, alias: str) -> None:
        self._aliases.pop(alias, None)

    def alias_version(self, alias: str) -> str | None:
        return self._aliases.get(alias)

    def set_tags(self, version: str, tags: Mapping[str, str]) -> None:
        self._tags[self._check(version)].update({k: str(v) for k, v in tags.items()})

    def get_tags(self, version: str) -> dict[str, str]:
        return dict(self._tags[self._check(version)])

    def download(self, version: str, dst_dir: str | Path) -> Path:
        version = self._check(version)
        dst = Path(dst_dir) / "policy"
        shutil.copytree(self._root / version / "policy", dst, dirs_exist_ok=True)
        return dst

    def versions(self) -> list[str]:
        return sorted(self._tags, key=int)
