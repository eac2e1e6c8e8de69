"""``rtrl serve gateway``: the gateway process. Wires the server (services/gateway/server.py)
to the routing table in Redis, the models (MLflow or upstream engines), the exposure log
(Kafka) and the served counts, then serves until SIGTERM and drains.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from deployer.adapters.served_counts import ServedCounts
from deployer.routing import Arm, RoutingTable
from ingest.contracts.keys import engine_model_key
from ingest.contracts.prometheus import registry_for
from services.gateway.asgi.relay import AsyncEngineClient
from services.gateway.engine_backend import EngineBackend, EngineClient
from services.gateway.exposure import ExposureLogger, ExposureProcess, make_event_producer
from services.gateway.models import Backend, ModelSlots, policy_loader
from services.gateway.request_ids import RequestIds
from services.gateway.routing import ChampionCache, RedisRoutingSource, RoutingPoller
from services.gateway.server import Gateway
from services.gateway.upstream import UpstreamBackend
from services.runtime.health import Health
from services.runtime.redis_io import make_redis
from services.settings.engine import EngineSettings
from services.settings.services import GatewaySettings

log = logging.getLogger("services.gateway")


def engine_loader(settings: Any, redis_client: Any) -> Callable[[Arm, str], Backend]:
    """Engine kind ``vllm``: a version is served as the model name the deployer recorded for
    it once it was loaded into the engine (``ingest.contracts.keys.engine_model_key``); the base
    version is the engine's base model."""
    eng: EngineSettings = settings.engine
    key = eng.api_key.get_secret_value() if eng.api_key is not None else None
    client = EngineClient(str(eng.base_url), key, eng.timeout_s)
    relay = AsyncEngineClient(str(eng.base_url), key, eng.timeout_s,
                              max_connections=settings.gateway.max_connections)
    prefix = settings.redis.key_prefix

    def load(arm: Arm, version: str) -> Backend:
        if version == eng.base_version:
            return EngineBackend(client, str(eng.base_model), relay)
        name = redis_client.get(engine_model_key(prefix, version))
        if not name:
            raise RuntimeError(f"version {version} is not loaded in the engine yet (the deployer "
                               "loads it and records its model name before routing traffic to it)")
        return EngineBackend(client, name.decode() if isinstance(name, bytes) else str(name), relay)

    return load


def upstream_relay(base_url: str, api_key: str | None, timeout_s: float) -> AsyncEngineClient:
    return AsyncEngineClient(base_url, api_key, timeout_s, name="upstream")


def engine_problem(settings: Any) -> str | None:
    """Why the engine settings cannot work (None: they can)."""
    eng: EngineSettings = settings.engine
    if eng.kind != "vllm":
        return None
    missing = [n for n in ("base_url", "base_model") if not getattr(eng, n)]
    if missing:
        return "RTRL_ENGINE__KIND=vllm needs " + " and ".join(f"RTRL_ENGINE__{n.upper()}" for n in missing)
    if settings.gateway.stable_upstream is not None:
        return "set either RTRL_ENGINE__KIND=vllm or RTRL_GATEWAY__STABLE_UPSTREAM, not both"
    return None


def registry(settings: Any) -> Any:
    from deployer.adapters.mlflow_registry import MlflowRegistry

    mlf = settings.mlflow
    return MlflowRegistry(mlf.tracking_uri, mlf.registered_model, mlf.training_experiment)


def champion_reader(settings: Any) -> Callable[[], str | None]:
    """The registry's champion alias, for a gateway whose models are on an engine. The MLflow
    client (about 125 MiB per worker) is made on the first read, which a gateway never does
    while the routing table the deployer writes to Redis names the stable version."""
    made: list[Any] = []

    def read() -> str | None:
        if not made:
            made.append(registry(settings))
        version: str | None = made[0].alias_version("champion")
        return version

    return read


def build(settings: Any, health: Health, exposures: Any = None,
          metrics: Any = None) -> tuple[Gateway, list[Any]]:
    """Wire the gateway from settings; returns it and its background parts (started).
    ``exposures``: where served events go (default: a Kafka producer, in a child process
    when ``gateway.exposure_process``); ``metrics``: the registry ``/metrics`` serves (default: this
    process's gateway metrics)."""

    gw: GatewaySettings = settings.gateway
    base: str | None = None
    if settings.engine.kind == "vllm":
        # a "load" is one Redis read of the model name the deployer recorded: retried every
        # second at most, so a version is served within a second of being loaded and checked
        slots = ModelSlots(engine_loader(settings, make_redis(settings.redis)), min(gw.load_retry_s, 1.0))
        champion = ChampionCache(champion_reader(settings), gw.champion_refresh_s).get
        model_name = settings.mlflow.registered_model
        base = settings.engine.base_version
    elif gw.stable_upstream is not None:
        ups = {"stable": gw.stable_upstream, "canary": gw.canary_upstream}

        def load_upstream(arm: Arm, version: str) -> Backend:
            cfg = ups[arm]
            if cfg is None:
                raise RuntimeError(f"no upstream configured for the {arm} arm")
            return UpstreamBackend(cfg, gw.upstream_timeout_s, gw.upstream_token_ids, relay=upstream_relay)

        slots = ModelSlots(load_upstream, gw.load_retry_s, share_across_arms=False)
        champion = None
        model_name = gw.stable_upstream.model
    else:
        import torch

        torch.set_num_threads(gw.torch_threads)
        source = registry(settings)
        slots = ModelSlots(policy_loader(source, gw.model_cache_dir, gw.min_tokens), gw.load_retry_s)
        champion = ChampionCache(lambda: source.alias_version("champion"), gw.champion_refresh_s).get
        model_name = settings.mlflow.registered_model

    warned: list[str] = []

    def on_table(table: RoutingTable, stable: str | None) -> None:
        h = table.holdout
        held = h.version if h is not None and h.active(time.time()) else None
        if gw.stable_upstream is not None:
            stable = stable or gw.stable_upstream.version or gw.stable_upstream.model
            canary = table.canary_version if gw.canary_upstream is not None else None
            if held is not None and h is not None and h.id not in warned:
                warned.append(h.id)  # fixed upstreams serve no pinned version: say so once
                log.warning("holdout %s pins v%s, but fixed upstreams cannot serve it: its users "
                            "are served by stable (docs/holdout.md)", h.id, held)
            slots.want(stable, canary)
        else:
            slots.want(stable or base, table.canary_version, held)

    if exposures is None:
        exposures = (ExposureProcess(settings, gw.exposure_queue) if gw.exposure_process
                     else ExposureLogger(lambda: make_event_producer(settings), gw.exposure_queue))
    poller = RoutingPoller(
        RedisRoutingSource(make_redis(settings.redis), settings.redis.key_prefix),
        on_table, champion, gw.routing_poll_s, beat=health.beat,
    )
    health.add_check("champion_loaded", lambda: slots.get("stable") is not None)
    # advisory: the gateway answers without the broker (its served events are lost, counted
    # and alerted: RtrlExposuresLost); leaving the Service would stop every answer instead
    health.add_check("broker", lambda: exposures.healthy, required=False)
    counts = ServedCounts(make_redis(settings.redis), settings.redis.key_prefix)
    gateway = Gateway(gw, slots, lambda: poller.table, exposures.log, model_name, health,
                      registry=metrics or registry_for("gateway"), count=counts.count,
                      request_ids=RequestIds(make_redis(settings.redis), settings.redis.key_prefix))
    exposures.start()
    slots.start()
    poller.start()
    counts.start()
    return gateway, [poller, slots, exposures, counts]
