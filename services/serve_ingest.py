"""``rtrl serve ingest``: validate, authenticate and dedup raw events, exactly once.

The process entry point only: what it runs is built in ``services/wiring/ingest.py``
(whose docstring says how it works).
"""

from __future__ import annotations

import argparse

from ingest.contracts import prometheus as m
from services.runtime.flags import deprecated_alias
from services.runtime.health import HttpEndpoints
from services.runtime.process import Stopper, setup_logging
from services.settings.model import get_settings
from services.wiring.ingest import SERVICE, run_worker


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="rtrl serve ingest",
        description="Validate, authenticate and dedup raw events; forward them exactly once.")
    parser.add_argument("--port", type=int, default=None,
                        help="port for /metrics /healthz /readyz (default: RTRL_HTTP__PORT, 0 = free port)")
    deprecated_alias(parser, "--metrics-port", "--port")
    parser.add_argument("--group-id", default=None, help="consumer group (default: RTRL_INGEST__GROUP_ID)")
    parser.add_argument("--max-batch", type=int, default=None,
                        help="records per poll and per transaction (default: RTRL_INGEST__MAX_BATCH)")
    parser.add_argument("--instance-id", default=None,
                        help="stable replica identity, e.g. the pod name (default: RTRL_INGEST__INSTANCE_ID)")
    args = parser.parse_args(argv)
    settings = get_settings()
    if args.instance_id:
        ingest = settings.ingest.model_copy(update={"instance_id": args.instance_id})
        settings = settings.model_copy(update={"ingest": ingest})
    setup_logging(settings.log_level, SERVICE)
    m.BUILD_INFO.info({"rtrl_service": SERVICE})
    stopper = Stopper().install()

    def announce(http: HttpEndpoints) -> None:
        print(f"rtrl ingest: metrics on http://{settings.http.host}:{http.port}/metrics", flush=True)

    return run_worker(settings, stopper, args.group_id, args.max_batch, args.port, announce)
