"""``rtrl up``, ``rtrl down`` and ``rtrl stack``: the embedded stack (services/stack/embedded.py)
from the command line."""

from __future__ import annotations

import json
import sys
import time

from services.stack.embedded import stack_from_settings

USAGE = """usage: rtrl up | rtrl down | rtrl stack [status] [--json]

  up      start the embedded stack (Kafka-protocol broker, Redis, MLflow) in the background
  down    stop it (data stays in RTRL_STACK__DATA_DIR)
  status  what runs and how to connect (--json: one JSON document)"""


def main(argv: list[str]) -> int:
    """rtrl up | down | stack status"""
    if any(a in {"-h", "--help"} for a in argv):
        print(USAGE)
        return 0
    as_json = "--json" in argv
    argv = [a for a in argv if a != "--json"]
    cmd = argv[0] if argv else "status"
    stack = stack_from_settings()
    if cmd == "up":
        print(f"starting the embedded stack in {stack.data_dir} ...", flush=True)
        t0 = time.monotonic()
        stack.up()
        print(f"ready in {time.monotonic() - t0:.1f}s")
        for name, line in stack.status().items():
            print(f"  {name:7s} {line}")
        print(f"settings for rtrl services: {stack.env_file} (read automatically)")
        for k, v in stack.env().items():
            print(f"  export {k}={v}")
        return 0
    if cmd == "down":
        stopped = stack.down()
        print(f"stopped: {', '.join(stopped) or 'nothing was running'}")
        return 0
    if cmd == "status" and as_json:
        services = {name: dict(zip(("state", "address"), line.split(None, 1), strict=False))
                    for name, line in stack.status().items()}
        print(json.dumps({"data_dir": str(stack.data_dir), "services": services}, indent=2))
        return 0
    if cmd == "status":
        for name, line in stack.status().items():
            print(f"  {name:7s} {line}")
        return 0
    print(f"unknown stack command {cmd!r}; use up, down or status", file=sys.stderr)
    return 2
