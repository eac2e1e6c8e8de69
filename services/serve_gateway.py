"""``rtrl serve gateway``: the gateway process. Wires the server (services/gateway/server.py)
to the routing table in Redis, the models (MLflow or upstream engines), the exposure log
(Kafka) and the served counts, then serves until SIGTERM and drains.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from deployer.routing import Arm, RoutingTable
from services.gateway.counts import ServedCounts
from services.gateway.exposure import ExposureLogger, ExposureProcess, make_event_producer
from services.gateway.models import Backend, ModelSlots, policy_loader
from services.gateway.routing import ChampionCache, RedisRoutingSource, RoutingPoller
from services.gateway.server import Gateway, GatewayServer
from services.gateway.upstream import UpstreamBackend
from services.runtime.health import Health
from services.runtime.process import Stopper, setup_logging
from services.runtime.redis_io import make_redis
from services.runtime.service_settings import GatewaySettings
from services.runtime.settings import get_settings

log = logging.getLogger("services.gateway")


def build(settings: Any, health: Health) -> tuple[Gateway, list[Any]]:
    """Wire the gateway from settings; returns it and its background parts (started)."""

    gw: GatewaySettings = settings.gateway
    if gw.stable_upstream is not None:
        ups = {"stable": gw.stable_upstream, "canary": gw.canary_upstream}

        def load_upstream(arm: Arm, version: str) -> Backend:
            cfg = ups[arm]
            if cfg is None:
                raise RuntimeError(f"no upstream configured for the {arm} arm")
            return UpstreamBackend(cfg, gw.upstream_timeout_s, gw.upstream_token_ids)

        slots = ModelSlots(load_upstream, gw.load_retry_s, share_across_arms=False)
        champion = None
        model_name = gw.stable_upstream.model
    else:
        import torch

        torch.set_num_threads(gw.torch_threads)
        from deployer.adapters.mlflow_registry import MlflowRegistry

        mlf = settings.mlflow
        source = MlflowRegistry(mlf.tracking_uri, mlf.registered_model, mlf.training_experiment)
        slots = ModelSlots(policy_loader(source, gw.model_cache_dir, gw.min_tokens), gw.load_retry_s)
        champion = ChampionCache(lambda: source.alias_version("champion"), gw.champion_refresh_s).get
        model_name = settings.mlflow.registered_model

    def on_table(table: RoutingTable, stable: str | None) -> None:
        if gw.stable_upstream is not None:
            stable = stable or gw.stable_upstream.version or gw.stable_upstream.model
            canary = table.canary_version if gw.canary_upstream is not None else None
            slots.want(stable, canary)
        else:
            slots.want(stable, table.canary_version)

    exposures: ExposureLogger | ExposureProcess
    if gw.exposure_process:
        exposures = ExposureProcess(settings, gw.exposure_queue)
    else:
        exposures = ExposureLogger(lambda: make_event_producer(settings), gw.exposure_queue)
    poller = RoutingPoller(
        RedisRoutingSource(make_redis(settings.redis), settings.redis.key_prefix),
        on_table, champion, gw.routing_poll_s, beat=health.beat,
    )
    health.add_check("champion_loaded", lambda: slots.get("stable") is not None)
    health.add_check("broker", lambda: exposures.healthy)
    counts = ServedCounts(make_redis(settings.redis), settings.redis.key_prefix)
    gateway = Gateway(gw, slots, lambda: poller.table, exposures.log, model_name, health,
                      count=counts.count)
    exposures.start()
    slots.start()
    poller.start()
    counts.start()
    return gateway, [poller, slots, exposures, counts]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="rtrl serve gateway", description="Serve completions, route users to arms, log every exposure.")
    parser.add_argument("--port", type=int, help="API port (default: RTRL_GATEWAY__PORT, 8080)")
    args = parser.parse_args(argv)

    settings = get_settings()
    if args.port is not None:
        gateway_settings = settings.gateway.model_copy(update={"port": args.port})
        settings = settings.model_copy(update={"gateway": gateway_settings})
    setup_logging(settings.log_level, "gateway")
    gw = settings.gateway
    if gw.key_id is not None and gw.secret is None and gw.key_id not in settings.auth.keys:
        log.error("no signing secret for key id %r: set RTRL_GATEWAY__SECRET (or RTRL_AUTH__KEYS), "
                  "or RTRL_GATEWAY__KEY_ID=null to send unsigned events (development)", gw.key_id)
        return 2
    stopper = Stopper().install()
    health = Health(liveness_timeout_s=max(30.0, 10 * gw.routing_poll_s))
    gateway, parts = build(settings, health)
    server = GatewayServer(gateway, gw.host, gw.port).start()
    log.info("gateway on http://%s:%d (API, /metrics, /healthz, /readyz)", gw.host, server.port)
    stopper.wait()
    log.info("stopping: draining requests, flushing served events")
    server.stop()
    poller, slots, exposures, counts = parts
    poller.stop()
    slots.stop()
    exposures.stop()
    counts.stop()
    return 0
