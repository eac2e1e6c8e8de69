"""rtrl serve deployer: the canary controller.

Every ``deployer.tick_s`` seconds, while it holds the controller lease in Redis (so at most
one controller, hence one canary, acts at a time): load the persisted status, read the
observations (registry aliases and gate tags, the queued operator commands once their
signatures are verified (deployer/operators.py), and for a canary in progress the reward
records of its window from the rewards topic, judged by the rollback judge), run the pure
transition ``deployer.canary.next_state``, apply its actions (routing keys in Redis, aliases
and tags in the MLflow registry, the decision ledger in MLflow) and persist the status.
SIGTERM finishes the current tick, releases the lease and exits 0.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from deployer import cohorts
from deployer.actions import Action, LedgerPort, LedgerStep, RoutingPort, apply_actions
from deployer.adapters.redis_state import ControllerState, RedisRouting
from deployer.adapters.vllm_engine import VllmEngine
from deployer.adapters.webhook import WebhookNotifier
from deployer.controller import tick
from deployer.engine import EnginePort
from deployer.ledger import TAG_GATE
from deployer.notify import NotifyPort, notice_of
from deployer.operators import screen
from deployer.registry import CANDIDATE, CHAMPION, PREVIOUS, Registry
from deployer.routing import parse_holdout
from deployer.status import (
    JUDGED,
    CanaryPolicy,
    CanaryStatus,
    Command,
    Observations,
)
from rollback.judge import judge
from rollback.types import GuardrailPolicy, JudgePolicy, default_metrics
from services.runtime import metrics as m
from services.runtime.canary_metrics import export_metrics
from services.runtime.flags import deprecated_alias
from services.runtime.group_lag import BrokerOffsets, GroupLagMonitor
from services.runtime.health import Health, HttpEndpoints
from services.runtime.kafka_io import ensure_topics, make_admin, make_consumer, wait_for_broker
from services.runtime.mlflow_http import bound_mlflow_http, retry_later
from services.runtime.operator_keys import authority
from services.runtime.process import Stopper, setup_logging
from services.runtime.redis_io import make_redis
from services.runtime.reward_tail import HoldoutMonitor, RewardReader
from services.runtime.service_settings import DeployerSettings
from services.runtime.settings import Settings, get_settings

SERVICE = "deployer"
log = logging.getLogger("rtrl.deployer")


def canary_policy(d: DeployerSettings) -> CanaryPolicy:
    return CanaryPolicy(steps=tuple(d.steps), bake_s=d.bake_s, max_duration_s=d.max_duration_s,
                        max_errors=d.max_errors, approval_required=d.approval.required,
                        approval_timeout_s=d.approval.timeout_s)


def judge_policy(d: DeployerSettings) -> JudgePolicy:
    specs = default_metrics()
    unknown = set(d.judge_mde) - {s.name for s in specs}
    if unknown:
        raise ValueError(f"deployer.judge_mde names unknown metrics {sorted(unknown)}; "
                         f"known: {[s.name for s in specs]}")
    return JudgePolicy(
        metrics=tuple(replace(s, mde=d.judge_mde.get(s.name, s.mde)) for s in specs),
        alpha=d.judge_alpha, min_users=d.judge_min_users, max_users=d.judge_max_users,
        max_duration_s=d.max_duration_s, stratum_s=d.judge_stratum_s,
        user_weight_cap=d.judge_user_weight_cap,
        guardrails=GuardrailPolicy(max_error_rate=d.judge_max_error_rate,
                                   max_p99_latency_ms=d.judge_max_p99_latency_ms,
                                   min_requests=d.judge_min_requests),
    )


@dataclass
class Ports:
    routing: RoutingPort
    registry: Registry
    """Aliases and version tags."""
    ledger: LedgerPort
    state: ControllerState
    """Status, lease and operator commands."""
    engine: EnginePort | None = None
    """The inference engine candidates are loaded into (None: local policies)."""
    notifier: NotifyPort | None = None
    """Where decisions are announced (None: no webhooks configured)."""


class Controller:
    """One tick at a time; ``step`` is what the loop, the operator CLI and tests call."""

    def __init__(self, settings: Settings, ports: Ports, rewards: RewardReader | None,
                 clock: Callable[[], float] = time.time, holdout: HoldoutMonitor | None = None) -> None:
        self.settings, self.ports, self.rewards, self.clock = settings, ports, rewards, clock
        self.policy = canary_policy(settings.deployer)
        self.judge_policy = judge_policy(settings.deployer)
        self.holdout = holdout
        """Measures the champion against the long-term holdout (None: not in this process)."""
        uri = settings.mlflow.tracking_uri
        self.ui_url = settings.notify.mlflow_ui_url or (uri if uri.startswith(("http:", "https:")) else None)
        """Where links in notices point (the MLflow UI)."""

    def step(self) -> CanaryStatus | None:
        """Run one tick if this controller holds (or takes) the lease; None otherwise."""
        st = self.ports.state
        if not st.acquire(self.settings.deployer.lease_ttl_s):
            log.info("another controller (%s) holds the lease; waiting", st.holder())
            return None
        before = st.load()
        pending = st.pending()
        ops = self.settings.operators
        checked = screen(pending, {cid for cid, _ in before.handled}, authority(ops), self.clock(),
                         st.seen([c.id for c in pending]))
        obs = replace(self.observe(before, checked.accepted), refused=checked.refused)

        def apply(actions: list[Action]) -> None:
            apply_actions(actions, self.ports.routing, self.ports.registry, self.ports.ledger,
                          self.ports.engine)

        after = tick(before, obs, self.policy, apply, st.save)
        st.remember([c.id for c in checked.accepted if c.id not in dict(before.handled)], 2 * ops.max_age_s)
        st.trim({cid for cid, _ in after.handled})
        for command, result in checked.counts:
            m.OPERATOR_COMMANDS.labels(command, result).inc()
        export_metrics(before, after, obs)
        notice = notice_of(before, after, obs.now, self.settings.mlflow.registered_model, self.ui_url)
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
            retry_later(SERVICE, "holdout measurement", exc, log)

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
        try:
            window = self.rewards.read(status)
            stable, canary = window.cohorts(*self.rewards.served_counts(status))
            verdict = judge(stable, canary, self.judge_policy, dict(status.judge_state),
                            elapsed_s=obs.now - status.started_at,
                            boundaries=(status.started_at, *status.step_times))
        except Exception as exc:  # any failure to observe is counted by the state machine
            log.exception("observing canary %s failed", status.canary_id)
            return replace(obs, error=f"{type(exc).__name__}: {exc}")
        return replace(obs, judgement=cohorts.judgement(verdict),
                       cohorts=cohorts.cohort_metrics(stable, canary))

    def _tags(self, version: str) -> dict[str, str]:
        try:
            return self.ports.registry.get_tags(version)
        except KeyError:  # an alias or command naming a version that does not exist
            return {}


def run_tick(controller: Controller) -> CanaryStatus | None:
    """One tick of the service loop. A failed tick changes nothing persisted and the next one
    retries it; a failure of MLflow, Redis or Kafka is counted in
    ``rtrl_dependency_retries_total{service="deployer"}``."""
    try:
        return controller.step()
    except Exception as exc:
        retry_later(SERVICE, "tick", exc, log)
        return None


def build_ports(settings: Settings, owner: str | None = None, redis_client: Any = None) -> Ports:
    """The controller's ports; ``redis_client`` replaces the service's own (the operator
    commands pass one with short timeouts)."""
    from deployer.adapters.ledger_mlflow import MlflowLedger
    from deployer.adapters.mlflow_registry import MlflowRegistry

    r = redis_client if redis_client is not None else make_redis(settings.redis)
    prefix = settings.redis.key_prefix
    ml = settings.mlflow
    registry = MlflowRegistry(ml.tracking_uri, ml.registered_model, ml.training_experiment,
                              ml.deployments_experiment)
    return Ports(
        routing=RedisRouting(r, prefix),
        registry=registry,
        ledger=MlflowLedger(ml.tracking_uri, ml.deployments_experiment, ml.registered_model),
        state=ControllerState(r, prefix, owner),
        engine=build_engine(settings, r, registry),
        notifier=build_notifier(settings),
    )


def build_notifier(settings: Settings) -> WebhookNotifier | None:
    """The webhook sender of ``RTRL_NOTIFY__*`` (None without URLs)."""
    n = settings.notify
    if not n.urls:
        return None
    return WebhookNotifier([u.get_secret_value() for u in n.urls], n.format,
                           n.secret.get_secret_value().encode() if n.secret is not None else None,
                           n.timeout_s, n.retries, n.backoff_s, n.queue_size,
                           count=lambda result: m.NOTIFICATIONS.labels(result).inc())


def build_engine(settings: Settings, redis_client: Any, registry: Any) -> EnginePort | None:
    """The engine port for ``RTRL_ENGINE__KIND=vllm`` (None for local policies)."""
    eng = settings.engine
    if eng.kind != "vllm":
        return None
    if not eng.base_url or not eng.base_model or eng.adapter_dir is None:
        raise ValueError("RTRL_ENGINE__KIND=vllm needs RTRL_ENGINE__BASE_URL, RTRL_ENGINE__BASE_MODEL "
                         "and RTRL_ENGINE__ADAPTER_DIR (docs/serving.md)")
    key = eng.api_key.get_secret_value() if eng.api_key is not None else None
    return VllmEngine(eng.base_url, redis_client, settings.redis.key_prefix, registry,
                      settings.mlflow.registered_model, eng.base_model, eng.adapter_dir,
                      eng.engine_adapter_dir, key, settings.deployer.engine_check_tolerance, eng.timeout_s)


def holdout_monitor(settings: Settings, ports: Ports) -> HoldoutMonitor | None:
    """The champion-vs-holdout measurement of ``deployer.holdout_every_s`` (None: 0, off). Each
    measurement is a step of the holdout's ledger run (step = Unix seconds)."""
    every_s = settings.deployer.holdout_every_s
    if every_s <= 0:
        return None

    def record(holdout_id: str, now: float, metrics: dict[str, float]) -> None:
        ports.ledger.record(LedgerStep(holdout_id, int(now), now, metrics))

    return HoldoutMonitor(settings, judge_policy(settings.deployer), ports.state.r, record, every_s)


def start_lag_monitor(settings: Settings) -> GroupLagMonitor | None:
    """Reads the ingest and reward groups' lag from the broker in the background."""
    if settings.deployer.lag_interval_s <= 0:
        return None
    groups = [(settings.ingest.group_id, settings.topics.raw),
              (settings.reward.group_id, settings.topics.events)]

    def connect() -> BrokerOffsets:
        consumer = make_consumer(settings.kafka, None, allow_auto_create_topics=False)
        return BrokerOffsets(make_admin(settings.kafka), consumer)

    return GroupLagMonitor(SERVICE, groups, connect, settings.deployer.lag_interval_s).start()


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="rtrl serve deployer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--once", action="store_true", help="run one tick and exit")
    ap.add_argument("--tick-s", type=float, default=None, help="seconds between ticks (default: settings)")
    ap.add_argument("--port", type=int, default=None, help="port for /metrics /healthz /readyz")
    deprecated_alias(ap, "--metrics-port", "--port")
    args = ap.parse_args(argv)
    settings = get_settings()
    setup_logging(settings.log_level, SERVICE)
    bound_mlflow_http(settings.mlflow)  # a tick never waits minutes in MLflow's own retries
    tick_s = args.tick_s or settings.deployer.tick_s
    m.BUILD_INFO.info({"service": SERVICE})
    stopper = Stopper().install()
    wait_for_broker(settings.kafka)
    ensure_topics(settings, [settings.topics.rewards])
    ports = build_ports(settings)
    rewards = RewardReader(settings)
    holdout = holdout_monitor(settings, ports)
    controller = Controller(settings, ports, rewards, holdout=holdout)
    health = Health(liveness_timeout_s=max(60.0, 3 * tick_s))
    health.add_check("redis", lambda: bool(ports.state.r.ping()))
    port = args.port if args.port is not None else settings.http.port
    http = HttpEndpoints(health, settings.http.host, port, m.registry_for(SERVICE)).start()
    lag = start_lag_monitor(settings)
    log.info("deployer %s: tick every %.1fs, steps %s, bake %.0fs", ports.state.owner, tick_s,
             settings.deployer.steps, settings.deployer.bake_s)
    try:
        while not stopper.stopping:
            run_tick(controller)
            health.beat()
            if args.once:
                break
            stopper.wait(tick_s)
    finally:
        ports.state.release()
        rewards.close()
        if holdout is not None:
            holdout.close()
        if lag is not None:
            lag.stop()
        if isinstance(ports.notifier, WebhookNotifier):
            ports.notifier.close(timeout_s=settings.notify.timeout_s)
        http.stop()
    log.info("deployer stopped")
    return 0
