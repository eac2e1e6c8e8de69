"""rtrl serve deployer: the canary controller's loop.

Every ``deployer.tick_s`` seconds, one :meth:`deployer.controller.Controller.step` (while it
holds the controller lease in Redis, so at most one controller, hence one canary, acts at a
time), and at once (within a second) when the trainer offers a new candidate or an operator
queues a command (``deployer:wake``, deployer/adapters/redis_state.py). The controller, its
ports and policies are built from settings by ``services/wiring/deployer.py``. SIGTERM
finishes the current tick, releases the lease and exits 0.
"""

from __future__ import annotations

import argparse
import logging

from deployer.adapters.redis_state import Wakeup
from deployer.adapters.webhook import WebhookNotifier
from ingest.contracts import prometheus as m
from services.runtime.flags import deprecated_alias
from services.runtime.health import Health, HttpEndpoints
from services.runtime.kafka_io import ensure_topics, wait_for_broker
from services.runtime.mlflow_http import bound_mlflow_http
from services.runtime.process import Stopper, setup_logging
from services.settings.model import get_settings
from services.wiring.deployer import (
    SERVICE,
    build_controller,
    build_ports,
    holdout_monitor,
    reward_reader,
    serve_loop,
    start_lag_monitor,
)

log = logging.getLogger("rtrl.deployer")


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
    m.BUILD_INFO.info({"rtrl_service": SERVICE})
    stopper = Stopper().install()
    wait_for_broker(settings.kafka)
    ensure_topics(settings, [settings.topics.rewards])
    ports = build_ports(settings)
    rewards = reward_reader(settings)
    holdout = holdout_monitor(settings, ports)
    controller = build_controller(settings, ports, rewards, holdout=holdout)
    health = Health(liveness_timeout_s=max(60.0, 3 * tick_s))
    health.add_check("redis", lambda: bool(ports.state.r.ping()))
    port = args.port if args.port is not None else settings.http.port
    http = HttpEndpoints(health, settings.http.host, port, m.registry_for(SERVICE)).start()
    lag = start_lag_monitor(settings)
    wakeup = Wakeup(ports.state.r, settings.redis.key_prefix)
    log.info("deployer %s: tick every %.1fs, steps %s, bake %.0fs", ports.state.owner, tick_s,
             settings.deployer.steps, settings.deployer.bake_s)
    try:
        serve_loop(controller, wakeup, tick_s, stopper.wait, lambda _status: health.beat(), once=args.once)
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
