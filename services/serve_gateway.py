"""``rtrl serve gateway``: the gateway process. Wires the server (services/gateway/server.py)
to the routing table in Redis, the models (MLflow or upstream engines), the exposure log
(Kafka) and the served counts, then serves until SIGTERM and drains.

The process entry point only: its workers, shipper and their parent are
``services/wiring/gateway_workers.py``; what each worker runs is built in
``services/wiring/gateway.py`` (whose docstrings say how they work).
"""

from __future__ import annotations

import argparse

from services.runtime.process import setup_logging
from services.settings.model import get_settings
from services.wiring.gateway import engine_problem, log
from services.wiring.gateway_workers import serve


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
    problem = engine_problem(settings)
    if problem is not None:
        log.error("%s (docs/serving.md)", problem)
        return 2
    if not gw.api_keys and not gw.allow_anonymous:
        log.error("no API keys: set RTRL_GATEWAY__API_KEYS='{\"<key id>\": \"<key>\"}' (clients send "
                  "'Authorization: Bearer <key>'), or RTRL_GATEWAY__ALLOW_ANONYMOUS=true (development)")
        return 2
    return serve(settings)
