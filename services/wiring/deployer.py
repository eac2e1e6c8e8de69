"""The deployer built from settings: its policies, its ports and the controller.

Shared by ``rtrl serve deployer`` (which runs the loop), the operator CLI (one step), the
demo, the benchmarks and the integration tests. The controller itself is
``deployer/controller.py`` and knows nothing of settings.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import Any

from deployer.actions import LedgerStep
from deployer.adapters.canary_metrics import export_metrics
from deployer.adapters.group_lag import BrokerOffsets, GroupLagMonitor
from deployer.adapters.redis_state import ControllerState, RedisRouting, Wakeup
from deployer.adapters.reward_tail import HoldoutMonitor, RewardReader, RewardTail
from deployer.adapters.vllm_engine import VllmEngine
from deployer.adapters.webhook import WebhookNotifier
from deployer.controller import Controller, ControllerConfig, Ports
from deployer.engine import EnginePort
from deployer.status import SOON, CanaryPolicy, CanaryStatus, Observations
from ingest.contracts import prometheus as m
from ingest.contracts.metrics import PERSISTENCE_HORIZON_S
from ingest.reward.spec import load_spec
from rollback.metrics import session_metrics
from rollback.types import GuardrailPolicy, JudgePolicy, default_metrics
from services.runtime.kafka_io import make_admin, make_consumer
from services.runtime.mlflow_http import retry_later
from services.runtime.operator_keys import authority
from services.runtime.redis_io import make_redis
from services.settings.deployer import DeployerSettings
from services.settings.model import Settings

SERVICE = "deployer"
log = logging.getLogger("rtrl.deployer")


def canary_policy(d: DeployerSettings) -> CanaryPolicy:
    return CanaryPolicy(steps=tuple(d.steps), bake_s=d.bake_s, min_bake_s=d.min_bake_s,
                        max_duration_s=d.max_duration_s, budget_factor=d.budget_factor,
                        max_errors=d.max_errors, approval_required=d.approval.required,
                        approval_timeout_s=d.approval.timeout_s)


def judge_policy_for(settings: Settings) -> JudgePolicy:
    """The deployer's judge: the reward spec says at which horizon edit persistence is judged,
    and whether agent sessions are (a spec with a ``[session]`` table)."""
    spec = load_spec(settings.reward_spec)
    return judge_policy(settings.deployer, spec.persistence.primary_horizon_s,
                        sessions=spec.session is not None)


def persistence_horizon(settings: Settings) -> int:
    """The reward spec's primary horizon: edit persistence is judged where it is rewarded."""
    return load_spec(settings.reward_spec).persistence.primary_horizon_s


def judge_policy(d: DeployerSettings, horizon_s: int = PERSISTENCE_HORIZON_S,
                 sessions: bool = False) -> JudgePolicy:
    """The judge of ``d``'s settings; ``sessions``: the per-session metrics are judged too."""
    specs = default_metrics() + (session_metrics() if sessions else ())
    unknown = set(d.judge_mde) - {s.name for s in specs}
    if unknown:
        raise ValueError(f"deployer.judge_mde names unknown metrics {sorted(unknown)}; "
                         f"known: {[s.name for s in specs]}")
    return JudgePolicy(
        metrics=tuple(replace(s, mde=d.judge_mde.get(s.name, s.mde)) for s in specs),
        alpha=d.judge_alpha, min_users=d.judge_min_users, max_users=d.judge_max_users,
        rollback_min_users=d.judge_rollback_min_users,
        max_duration_s=d.max_duration_s, stratum_s=d.judge_stratum_s,
        user_weight_cap=d.judge_user_weight_cap, persistence_horizon_s=horizon_s,
        tail_cap_quantile=d.judge_tail_cap_quantile, require_improvement=d.judge_require_improvement,
        guardrails=GuardrailPolicy(max_error_rate=d.judge_max_error_rate,
                                   max_p99_latency_ms=d.judge_max_p99_latency_ms,
                                   min_requests=d.judge_min_requests),
    )


def controller_config(settings: Settings) -> ControllerConfig:
    uri = settings.mlflow.tracking_uri
    ops = settings.operators
    return ControllerConfig(
        policy=canary_policy(settings.deployer),
        judge=judge_policy_for(settings),
        authority=lambda: authority(ops), lease_ttl_s=settings.deployer.lease_ttl_s,
        command_max_age_s=ops.max_age_s, model_name=settings.mlflow.registered_model,
        ui_url=settings.notify.mlflow_ui_url or (uri if uri.startswith(("http:", "https:")) else None))


class ServiceHooks:
    """The deployer service's tick hooks: Prometheus metrics, and a failed side job counted
    in ``rtrl_dependency_retries_total{service="deployer"}``."""

    def ticked(self, before: CanaryStatus, after: CanaryStatus, obs: Observations,
               command_results: Collection[tuple[str, str]]) -> None:
        for command, result in command_results:
            m.OPERATOR_COMMANDS.labels(command, result).inc()
        export_metrics(before, after, obs)

    def failed(self, what: str, exc: Exception) -> None:
        retry_later(SERVICE, what, exc, log)


def build_controller(settings: Settings, ports: Ports, rewards: RewardReader | None,
                     clock: Callable[[], float] = time.time,
                     holdout: HoldoutMonitor | None = None) -> Controller:
    """The controller of ``settings`` over ``ports``, exporting the service's metrics."""
    return Controller(controller_config(settings), ports, rewards, clock, holdout, ServiceHooks())


@dataclass
class ServicePorts(Ports):
    """The ports on the real stack: the state is Redis's (its client checks health, queues
    commands and keeps the holdout's report)."""

    state: ControllerState


def build_ports(settings: Settings, owner: str | None = None, redis_client: Any = None) -> ServicePorts:
    """The controller's ports; ``redis_client`` replaces the service's own (the operator
    commands pass one with short timeouts)."""
    from deployer.adapters.ledger_mlflow import MlflowLedger
    from deployer.adapters.mlflow_registry import MlflowRegistry

    r = redis_client if redis_client is not None else make_redis(settings.redis)
    prefix = settings.redis.key_prefix
    ml = settings.mlflow
    registry = MlflowRegistry(ml.tracking_uri, ml.registered_model, ml.training_experiment,
                              ml.deployments_experiment)
    return ServicePorts(
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


def reward_tail(settings: Settings) -> RewardTail:
    """A reader of the rewards topic without a consumer group."""
    return RewardTail(make_consumer(settings.kafka, group_id=None), settings.topics.rewards,
                      settings.deployer.poll_timeout_ms)


def reward_reader(settings: Settings) -> RewardReader:
    """The current canary's reward records and the gateway's counts of its requests."""
    return RewardReader(make_consumer(settings.kafka, group_id=None), settings.topics.rewards,
                        settings.deployer.poll_timeout_ms, lambda: make_redis(settings.redis),
                        settings.redis.key_prefix, persistence_horizon(settings))


def holdout_monitor(settings: Settings, ports: ServicePorts) -> HoldoutMonitor | None:
    """The champion-vs-holdout measurement of ``deployer.holdout_every_s`` (None: 0, off). Each
    measurement is a step of the holdout's ledger run (step = Unix seconds)."""
    every_s = settings.deployer.holdout_every_s
    if every_s <= 0:
        return None

    def record(holdout_id: str, now: float, metrics: dict[str, float]) -> None:
        ports.ledger.record(LedgerStep(holdout_id, int(now), now, metrics))

    policy = judge_policy_for(settings)
    return HoldoutMonitor(lambda: reward_tail(settings), policy, ports.state.r, settings.redis.key_prefix,
                          record, every_s)


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


def run_tick(controller: Controller) -> CanaryStatus | None:
    """One tick of the service loop. A failed tick changes nothing persisted and the next one
    retries it; a failure of MLflow, Redis or Kafka is counted in
    ``rtrl_dependency_retries_total{service="deployer"}``."""
    try:
        return controller.step()
    except Exception as exc:
        retry_later(SERVICE, "tick", exc, log)
        return None


SOON_S = 1.0
"""The wait before the next tick in a :data:`deployer.status.SOON` phase."""


def serve_loop(controller: Controller, wakeup: Wakeup, tick_s: float, sleep: Callable[[float], bool],
               ticked: Callable[[CanaryStatus | None], None] = lambda _s: None, once: bool = False) -> None:
    """Tick, then wait ``tick_s`` (:data:`SOON_S` in a phase that should move on at once), cut
    short by a wake-up (a new candidate, an operator command); until ``sleep`` says stop."""
    while True:
        status = run_tick(controller)
        ticked(status)
        if once:
            return
        wait_s = min(tick_s, SOON_S) if status is not None and status.phase in SOON else tick_s
        reason = wakeup.wait(wait_s, sleep)
        if reason is None and sleep(0):
            return
        if reason:
            log.info("woken before the tick was due: %s", reason)
