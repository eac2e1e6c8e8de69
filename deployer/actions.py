"""What the canary controller asks the outside world to do, and how the actions are applied.

``next_state`` returns these plain dataclasses; ``apply_actions`` hands each one to the
port that carries it out (routing keys in Redis, aliases and tags in the MLflow registry,
the decision ledger in MLflow). Every action is idempotent: applying it twice leaves the
world as applying it once, so a controller killed between "apply" and "persist status"
simply re-applies the same actions on its next tick.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from deployer.engine import READY, EngineState
from deployer.routing import Holdout

# --------------------------------------------------------------------------- actions


@dataclass(frozen=True)
class SetRouting:
    """Write all routing keys at once: stable and canary versions, canary weight, salt.

    ``canary=None`` removes the canary version (the gateway then serves stable only)."""

    stable: str | None
    canary: str | None
    weight: float
    salt: str


@dataclass(frozen=True)
class SetHoldout:
    """Write (or, with ``holdout=None``, remove) the long-term holdout the gateway reads."""

    holdout: Holdout | None


@dataclass(frozen=True)
class SetWeight:
    """Change only the canary's share of users (0..1)."""

    weight: float


@dataclass(frozen=True)
class MoveAlias:
    """Point a registry alias (champion, candidate, previous) at a version."""

    alias: str
    version: str


@dataclass(frozen=True)
class DeleteAlias:
    """Remove an alias, but only while it still points at ``expected`` (a candidate
    registered in the meantime is never removed by mistake)."""

    alias: str
    expected: str


@dataclass(frozen=True)
class WriteTags:
    """Set tags on a model version (the outcome mirrored from the ledger)."""

    version: str
    tags: Mapping[str, str]


@dataclass(frozen=True)
class LedgerOpen:
    """Start (or find) the ledger run of one canary."""

    canary_id: str
    params: Mapping[str, str]
    tags: Mapping[str, str]
    ts: float


@dataclass(frozen=True)
class LedgerStep:
    """Record one judged tick: cohort metrics and the judge's statistics at ``step``."""

    canary_id: str
    step: int
    ts: float
    metrics: Mapping[str, float]


@dataclass(frozen=True)
class LedgerNote:
    """Record an event in the ledger run (e.g. an operator paused the canary)."""

    canary_id: str
    key: str
    text: str


@dataclass(frozen=True)
class LedgerClose:
    """Write the final decision, the reason and who decided; draw the plot; end the run."""

    canary_id: str
    ts: float
    tags: Mapping[str, str]
    summary: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class LedgerRefusal:
    """Record an operator command the deployer refused, as its own finished ledger run
    named ``canary_id`` (``refused-<kind>-<command id>``) with ``tags``."""

    canary_id: str
    ts: float
    tags: Mapping[str, str]


@dataclass(frozen=True)
class EngineLoad:
    """Ensure a version is loaded into the inference engine and checked (deployer/engine.py).
    The outcome is recorded by the engine port and observed on the next tick; with
    ``required`` a version that cannot be served fails the tick instead (the tick retries)."""

    version: str
    required: bool = False


@dataclass(frozen=True)
class EngineUnload:
    """Stop serving a version from the engine (rolled back, superseded or failed)."""

    version: str


LedgerEvent = LedgerOpen | LedgerStep | LedgerNote | LedgerClose | LedgerRefusal
EngineAction = EngineLoad | EngineUnload
RoutingAction = SetRouting | SetWeight | SetHoldout
Action = RoutingAction | MoveAlias | DeleteAlias | WriteTags | LedgerEvent | EngineAction

# --------------------------------------------------------------------------- ports


class RoutingPort(Protocol):
    """The routing keys the gateway polls (``{prefix}routing:*`` in Redis)."""

    def set_routing(self, stable: str | None, canary: str | None, weight: float, salt: str) -> None:
        """Write all keys in one transaction; raises on a Redis error (the tick retries)."""

    def set_weight(self, weight: float) -> None:
        """Write the canary weight only."""

    def set_holdout(self, holdout: Holdout | None) -> None:
        """Write the holdout's key (one JSON value), or delete it."""

    def read(self) -> dict[str, str | None]:
        """The raw routing values by field name (``deployer.routing.ROUTING_FIELDS``)."""


class AliasPort(Protocol):
    """The part of the model registry the controller moves (deployer/registry.py)."""

    def set_alias(self, alias: str, version: str) -> None: ...

    def delete_alias(self, alias: str) -> None: ...

    def alias_version(self, alias: str) -> str | None: ...

    def set_tags(self, version: str, tags: Mapping[str, str]) -> None: ...


class LedgerPort(Protocol):
    """The decision ledger (one MLflow run per canary)."""

    def record(self, event: LedgerEvent) -> None:
        """Apply one ledger event; each kind is idempotent for the same ``canary_id``."""


class EngineActions(Protocol):
    """The part of deployer.engine.EnginePort the actions use."""

    def ensure_loaded(self, version: str) -> EngineState: ...

    def unload(self, version: str) -> None: ...


def apply_engine(action: EngineAction, engine: EngineActions | None) -> None:
    if engine is None:
        raise RuntimeError(f"{action!r} needs an inference engine (RTRL_ENGINE__KIND=vllm)")
    if isinstance(action, EngineUnload):
        engine.unload(action.version)
        return
    state = engine.ensure_loaded(action.version)
    if action.required and state.state != READY:
        raise RuntimeError(f"version {action.version} cannot be served by the engine: {state.reason}")


def apply_routing(action: RoutingAction, routing: RoutingPort) -> None:
    match action:
        case SetRouting(stable=stable, canary=canary, weight=weight, salt=salt):
            routing.set_routing(stable, canary, weight, salt)
        case SetWeight(weight=weight):
            routing.set_weight(weight)
        case SetHoldout(holdout=holdout):
            routing.set_holdout(holdout)


def apply_actions(
    actions: Iterable[Action], routing: RoutingPort, registry: AliasPort, ledger: LedgerPort,
    engine: EngineActions | None = None,
) -> None:
    """Carry out ``actions`` in order. An exception stops at the failing action; the
    status is then not persisted and the next tick re-applies the whole list."""
    for action in actions:
        match action:
            case EngineLoad() | EngineUnload():
                apply_engine(action, engine)
            case SetRouting() | SetWeight() | SetHoldout():
                apply_routing(action, routing)
            case MoveAlias(alias=alias, version=version):
                registry.set_alias(alias, version)
            case DeleteAlias(alias=alias, expected=expected):
                current = registry.alias_version(alias)
                if current is not None and str(current) == str(expected):
                    registry.delete_alias(alias)
            case WriteTags(version=version, tags=tags):
                registry.set_tags(version, tags)
            case LedgerOpen() | LedgerStep() | LedgerNote() | LedgerClose() | LedgerRefusal():
                ledger.record(action)
            case _:
                raise TypeError(f"unknown action {action!r}")
