"""``rtrl serve reward``: join each request's events and emit exactly one reward record.

The process entry point only: what it runs is built in ``services/wiring/reward.py``
(whose docstring says how it works).
"""

from __future__ import annotations

import argparse
import faulthandler
import signal
from typing import Any

from ingest.contracts import prometheus as m
from ingest.reward.spec import load_spec
from services.runtime.exactly_once import FencedError
from services.runtime.flags import deprecated_alias
from services.runtime.health import Health, HttpEndpoints
from services.runtime.process import Stopper, setup_logging
from services.settings.model import get_settings
from services.wiring.reward import SERVICE, RewardWorker, log


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="rtrl serve reward", description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=None, help="port for /metrics /healthz /readyz")
    deprecated_alias(ap, "--metrics-port", "--port")
    ap.add_argument("--group-id", default=None, help="consumer group (default: settings)")
    ap.add_argument("--max-batch", type=int, default=None, help="most events per poll")
    ap.add_argument("--time-scale", type=float, default=None,
                    help="multiply the spec's window durations (e.g. 0.01 for demos)")
    ap.add_argument("--instance-id", default=None,
                    help="stable replica identity, e.g. the pod name: static group member and "
                         "transactional id base (default: settings)")
    ap.add_argument("--spec", default=None, help="reward spec TOML (default: settings, else packaged)")
    args = ap.parse_args(argv)
    stopper = Stopper().install()  # first: a SIGTERM during start-up is a clean stop too
    settings = get_settings()
    setup_logging(settings.log_level, SERVICE)
    upd: dict[str, Any] = {}
    if args.group_id:
        upd["group_id"] = args.group_id
    if args.max_batch:
        upd["max_batch"] = args.max_batch
    if args.time_scale is not None:
        upd["time_scale"] = args.time_scale
    if args.instance_id:
        upd["group_instance_id"] = args.instance_id
        upd["transactional_id"] = settings.reward.transactional_id or args.instance_id
    settings = settings.model_copy(update={"reward": settings.reward.model_copy(update=upd)})
    spec = load_spec(args.spec or settings.reward_spec)
    m.BUILD_INFO.info({"rtrl_service": SERVICE, "reward_spec": spec.version})
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` prints every thread's stack
    health = Health()
    port = args.port if args.port is not None else settings.http.port
    http = HttpEndpoints(health, settings.http.host, port, m.registry_for(SERVICE)).start()
    worker = RewardWorker(settings, spec, health)
    try:
        worker.start()
        worker.run(stopper)
        log.info("stopping: last batch committed")
    except FencedError as exc:
        log.error("%s; stopping", exc)
        return 3
    finally:
        worker.close()
        http.stop()
    return 0
