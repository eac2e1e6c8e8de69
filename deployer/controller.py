"""The canary controller: one tick around the pure transition, and what it observes.

Each :meth:`Controller.step`, while this controller holds the lease (so at most one
controller, hence one canary, acts at a time): load the persisted status, read the
observations (registry aliases and gate tags, the queued operator commands once their
signatures are verified (deployer/operators.py), and for a canary in progress the reward
records of its window, judged by the rollback judge), run ``deployer.canary.next_state``,
apply its actions and persist the status.

The controller takes policies and small ports, never settings: ``services/wiring/deployer.py``
builds them from the environment, ``services/serve_deployer.py`` runs the loop, the operator
CLI runs one step, and the unit tests drive it against the in-memory fakes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import Protocol

from deployer import cohorts
from deployer.actions import Action, LedgerPort, RoutingPort, apply_actions
from deployer.canary import next_state
from deployer.engine import EnginePort
from deployer.ledger import TAG_GATE
from deployer.notify import NotifyPort, notice_of
from deployer.operators import Authority, screen
from deployer.registry import Registry
from deployer.routing import Holdout, parse_holdout
from deployer.status import JUDGED, TRANSIENT, CanaryPolicy, CanaryStatus, Command, Observations
from ingest.contracts.registry import CANDIDATE, CHAMPION, PREVIOUS
from rollback.plan import plan_canary
from rollback.types import JudgePolicy

log = logging.getLogger("rtrl.deployer")

Counts = tuple[dict[str, int], dict[str, int], dict[str, list[tuple[str, float, int]]]]
"""The gateway's (requests, errors, errors by user) per arm since a canary started."""


def tick(
    status: CanaryStatus,
    obs: Observations,
    policy: CanaryPolicy,
    apply: Callable[[list[Action]], None],
    persist: Callable[[CanaryStatus], None],
) -> CanaryStatus:
    """Run ``next_state`` and apply its actions, persisting the status after each
    transition. A decision (promoting / rolling_back) is finished in the same tick; the
    status is persisted in between, so a crash there resumes in the finishing phase, whose
    actions depend on the status alone and are idempotent."""
    for _ in range(3):
        status, actions = next_state(status, obs, policy)
        apply(actions)
        persist(status)
        if status.phase not in TRANSIENT:
            break
        obs = replace(obs, commands=(), judgement=None)
    return status


class StatePort(Protocol):
    """The controller's persisted status, its lease and the operator command queue
    (``deployer/adapters/redis_state.ControllerState``; a fake in the unit tier)."""

    owner: str

    def acquire(self, ttl_s: float) -> bool: ...
    def holder(self) -> str | None: ...
    def load(self) -> CanaryStatus: ...
    def save(self, status: CanaryStatus) -> None: ...
    def pending(self) -> tuple[Command, ...]: ...
    def seen(self, ids: list[str]) -> set[str]: ...
    def remember(self, ids: list[str], ttl_s: float) -> None: ...
    def trim(self, handled_ids: set[str]) -> None: ...
    def release(self) -> None: ...


class RewardsPort(Protocol):
    """The current canary's reward records and the gateway's counts of its requests
    (``deployer/adapters/reward_tail.RewardReader``)."""

    def read(self, status: CanaryStatus) -> cohorts.CohortWindow: ...
    def served_counts(self, status: CanaryStatus) -> Counts: ...


class HoldoutPort(Protocol):
    """The champion against the long-term holdout (``reward_tail.HoldoutMonitor``)."""

    def due(self, now: float) -> bool: ...
    def measure(self, h: Holdout | None, champion: str | None, now: float) -> object: ...


@dataclass
class Ports:
    routing: RoutingPort
    registry: Registry
    """Aliases and version tags."""
    ledger: LedgerPort
    state: StatePort
    """Status, lease and operator commands."""
    engine: EnginePort | None = None
    """The inference engine candidates are loaded into (None: local policies)."""
    notifier: NotifyPort | None = None
    """Where decisions are announced (None: no webhooks configured)."""


@dataclass(frozen=True)
class ControllerConfig:
    """What the controller decides by (``services/wiring/deployer.py`` builds it from settings)."""

    policy: CanaryPolicy
    judge: JudgePolicy
    authority: Callable[[], Authority]
    """The operators' keys, read again every tick (a rotated key file takes effect at once)."""
    lease_ttl_s: float = 60.0
    command_max_age_s: float = 300.0
    """A command older than this is refused; accepted ids are remembered twice as long."""
    model_name: str = ""
    """The registered model, named in notices."""
    ui_url: str | None = None
    """Where links in notices point (the MLflow UI)."""


class TickHooks(Protocol):
    """What the process does with a finished tick (metrics) and a failed side job (logging
    and counting a dependency's failure)."""

    def ticked(self, before: CanaryStatus, after: CanaryStatus, obs: Observations,
               command_results: Collection[tuple[str, str]]) -> None: ...
    def failed(self, what: str, exc: Exception) -> None: ...


class QuietHooks:
    """Hooks that only log (the operator CLI's one-off step, tests)."""

    def ticked(self, before: CanaryStatus, after: CanaryStatus, obs: Observations,
               command_results: Collection[tuple[str, str]]) -> None:
        return None

    def failed(self, what: str, exc: Exception) -> None:
        log.warning("%s failed: %s: %s", what, type(exc).__name__, exc)


class Controller:
    """One tick at a time; ``step`` is what the loop, the operator CLI and tests call."""

    def __init__(self, config: ControllerConfig, ports: Ports, rewards: RewardsPort | None,
                 clock: Callable[[], float] = time.time, holdout: HoldoutPort | None = None,
                 hooks: TickHooks | None = None) -> None:
        self.config, self.ports, self.rewards, self.clock = config, ports, rewards, clock
        self.holdout = holdout
        """Measures the champion against the long-term holdout (None: not in this process)."""
        self.hooks: TickHooks = hooks if hooks is not None else QuietHooks()

    def step(self) -> CanaryStatus | None:
        """Run one tick if this controller holds (or takes) the lease; None otherwise."""
        st, cfg = self.ports.state, self.config
        if not st.acquire(cfg.lease_ttl_s):
            log.info("another controller (%s) holds the lease; waiting", st.holder())
            return None
        before = st.load()
        pending = st.pending()
        checked = screen(pending, {cid for cid, _ in before.handled}, cfg.authority(), self.clock(),
                         st.seen([c.id for c in pending]))
        obs = replace(self.observe(before, checked.accepted), refused=checked.refused)

        def apply(actions: list[Action]) -> None:
            apply_actions(actions, self.ports.routing, self.ports.registry, self.ports.ledger,
                          self.ports.engine)

        after = tick(before, obs, cfg.policy, apply, st.save)
        st.remember([c.id for c in checked.accepted if c.id not in dict(before.handled)],
                    2 * cfg.command_max_age_s)
        st.trim({cid for cid, _ in after.handled})
        self.hooks.ticked(before, after, obs, checked.counts)
        notice = notice_of(before, after, obs.now, cfg.model_name, cfg.ui_url)
        if notice is not None and self.ports.notifier is not None:
            self.ports.notifier.send(notice)  # queued: a slow receiver never delays the tick
        if after.phase != before.phase:
            log.info("canary %s: %s -> %s %s", after.canary_id, before.phase, after.phase, after.reason)
        self.measure_holdout(obs)
        return after

    def measure_holdout(self, obs: Observations) -> None:
        """The champion against the long-term holdout, when due. Its failure is logged and
        counted but never fails the tick: the canary does not wait on it."""
        if self.holdout is None or not self.holdout.due(obs.now):
            return
        try:  # after the tick: a command of this tick may have changed the holdout
            h = parse_holdout(self.ports.routing.read().get("holdout"))[0]
            champion = self.ports.registry.alias_version(CHAMPION) if h is not None else None
            self.holdout.measure(h, champion, obs.now)
        except Exception as exc:
            self.hooks.failed("holdout measurement", exc)

    def observe(self, status: CanaryStatus, commands: tuple[Command, ...]) -> Observations:
        reg = self.ports.registry
        champion, candidate, previous = (reg.alias_version(a) for a in (CHAMPION, CANDIDATE, PREVIOUS))
        wanted = {candidate, previous, *(c.version for c in commands)} - {None}
        tags = {v: self._tags(v) for v in wanted if v}
        holdout, problem = parse_holdout(self.ports.routing.read().get("holdout"))
        if problem:
            log.error("routing table: %s", problem)
        obs = Observations(now=self.clock(), champion=champion, candidate=candidate, previous=previous,
                           holdout=holdout,
                           gate={v: t.get(TAG_GATE, "") for v, t in tags.items()}, lineage=tags,
                           commands=commands,
                           engine=self.ports.engine.states() if self.ports.engine is not None else None)
        if status.phase not in JUDGED:
            return obs
        if self.rewards is None:
            return replace(obs, error="no rewards reader in this process")
        return self._judged(status, obs, self.rewards)

    def _judged(self, status: CanaryStatus, obs: Observations, rewards: RewardsPort) -> Observations:
        try:
            window = rewards.read(status)
            requests, errors, user_errors = rewards.served_counts(status)
            on = cohorts.JudgedOn(status.started_at, obs.now, status.step_times, requests, errors,
                                  user_errors, dict(window.read_to))
            verdict, stable, canary = cohorts.judge_window(window, self.config.judge, on,
                                                           dict(status.judge_state))
        except Exception as exc:  # any failure to observe is counted by the state machine
            log.exception("observing canary %s failed", status.canary_id)
            return replace(obs, error=f"{type(exc).__name__}: {exc}")
        policy = self.config.policy
        plan = plan_canary(verdict, self.config.judge, policy.steps, status.step,
                           obs.now - status.step_since, obs.now - status.started_at, policy.bake_s)
        if plan.warning and not status.plan.get("warning"):
            log.warning("canary %s: %s", status.canary_id, plan.warning)
        return replace(obs, judgement=cohorts.judgement(verdict, on, plan),
                       cohorts=cohorts.cohort_metrics(stable, canary))

    def _tags(self, version: str) -> dict[str, str]:
        try:
            return self.ports.registry.get_tags(version)
        except KeyError:  # an alias or command naming a version that does not exist
            return {}
