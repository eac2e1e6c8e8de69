"""The ``rtrl`` command. Each sub-command lives in its own module with a ``main(argv)``;
this file only routes, so ``rtrl --help`` stays fast (no torch, Ray or MLflow import)."""

from __future__ import annotations

import importlib
import signal
import sys
from types import FrameType

from services.cli import exit_codes
from services.cli.backends import backend_failure, message
from services.settings.model import get_settings

# name -> (module, one-line help). "serve" and "bench" route on their second word.
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("services.cli.stack", "start the embedded stack (Kafka-protocol broker, Redis, MLflow)"),
    "down": ("services.cli.stack", "stop the embedded stack"),
    "stack": ("services.cli.stack", "stack status: what runs and how to connect"),
    "events": ("services.cli.events", "validate events files, export the JSON Schema"),
    "sample": ("services.cli.sample",
               "stream sample events through ingest and reward, print what happened"),
    "reconcile": ("services.cli.reconcile",
                  "account for every raw event: lost or duplicated events and rewards"),
    "replay": ("services.cli.replay", "recompute past rewards under another reward spec; what would change"),
    "train": ("services.cli.train", "run one RL increment now (train --now)"),
    "bootstrap": ("services.cli.train", "supervised first champion from a corpus file"),
    "status": ("services.cli.operator", "champion, candidate, canary phase, cohorts, verdict"),
    "history": ("services.cli.operator", "the decision ledger"),
    "promote": ("services.cli.operator", "promote a version by hand (recorded in the ledger)"),
    "rollback": ("services.cli.operator", "roll back by hand (recorded in the ledger)"),
    "pause": ("services.cli.operator", "pause the canary controller"),
    "resume": ("services.cli.operator", "resume the canary controller"),
    "approve": ("services.cli.operator", "approve the canary that awaits approval (promotes it)"),
    "holdout": ("services.cli.holdout", "the long-term holdout: show, pin, rotate or end it"),
    "demo": ("services.demo.run", "the closed loop on the embedded stack, with a report"),
    "version": ("services.cli.version", "the installed version (--json: with key dependencies)"),
}
SERVE: dict[str, tuple[str, str]] = {
    "ingest": ("services.serve_ingest", "validate, authenticate, dedup raw events"),
    "reward": ("services.serve_reward", "join events per request and emit rewards"),
    "trainer": ("services.serve_trainer", "scheduled RL increments (every 5 h by default)"),
    "gateway": ("services.serve_gateway", "serve completions, route arms, log exposures"),
    "deployer": ("services.serve_deployer", "canary controller with the rollback judge"),
    "simulator": ("services.sim.simulator", "simulated users driving the gateway"),
}
BENCH: dict[str, tuple[str, str]] = {
    "pipeline": ("bench.pipeline", "ingest and reward throughput vs a do-nothing pipe"),
    "trainer": ("bench.trainer", "RL step in Ray vs plain loop; increment overhead"),
    "trl": ("bench.trl_compare", "the policy-update step vs TRL's GRPO loss step (needs trl)"),
    "gateway": ("bench.gateway", "latency added by the gateway"),
    "judge": ("bench.judge", "false rollbacks and detection vs Kayenta/Flagger-style judges"),
    "loop-offline": ("bench.loop_offline", "the demo's users, rewards and increments in one process"),
    "agent-offline": ("bench.agent_offline", "the agent demo's sessions, credit, increments in one process"),
}


def _usage() -> str:
    lines = ["usage: rtrl <command> [args]   (rtrl <command> --help: its options; rtrl --version)",
             "", "commands:"]
    lines += [f"  {k:10s} {v[1]}" for k, v in COMMANDS.items()]
    lines += ["  serve      run a service: " + ", ".join(SERVE)]
    lines += ["  bench      run a benchmark: " + ", ".join(BENCH)]
    lines += ["", "commands that report take --json (one JSON document on stdout)", "", exit_codes.epilog()]
    return "\n".join(lines)


def _run(table: dict[str, tuple[str, str]], name: str, argv: list[str], what: str) -> int:
    if name not in table:
        print(f"rtrl: unknown {what} {name!r}\n\n{_usage()}", file=sys.stderr)
        return exit_codes.USAGE
    module = importlib.import_module(table[name][0])
    return int(module.main(argv) or 0)


def main(argv: list[str] | None = None) -> int:
    """Route to the command; a backend that cannot be reached becomes one line on stderr and
    exit code 4 (each operator command also bounds its calls, services/cli/backends.py), and
    Ctrl-C exit code 130, instead of a traceback."""
    args = list(sys.argv[1:] if argv is None else argv)
    head = args[0] if args else "help"
    try:
        return _route(args)
    except KeyboardInterrupt:
        print(f"rtrl {head}: interrupted", file=sys.stderr)
        return exit_codes.INTERRUPTED
    except Exception as exc:
        failure = backend_failure(exc)
        if failure is None:
            raise
        print(message(head, failure, get_settings(), None), file=sys.stderr)
        return exit_codes.UNAVAILABLE


def _interrupted(signum: int, frame: FrameType | None) -> None:
    """SIGTERM as Ctrl-C for a benchmark: its ``finally`` blocks stop the private stack and the
    processes it started (the default SIGTERM would leave them running)."""
    raise KeyboardInterrupt


def _route(args: list[str]) -> int:
    if not args or args[0] in {"-h", "--help", "help"}:
        print(_usage())
        return 0
    if args[0] in {"-V", "--version"}:
        return _run(COMMANDS, "version", args[1:], "command")
    head, rest = args[0], args[1:]
    if head in {"serve", "bench"}:
        table = SERVE if head == "serve" else BENCH
        if not rest or rest[0] in {"-h", "--help"}:
            print(f"usage: rtrl {head} {{{','.join(table)}}} [args]")
            for k, v in table.items():
                print(f"  {k:10s} {v[1]}")
            return 0 if rest else exit_codes.USAGE
        if head == "bench":
            signal.signal(signal.SIGTERM, _interrupted)
        return _run(table, rest[0], rest[1:], f"{head} target")
    if head in {"up", "down"}:
        return _run(COMMANDS, head, [head, *rest], "command")
    if head in {"status", "history", "promote", "rollback", "pause", "resume", "approve", "train",
                "bootstrap"}:
        return _run(COMMANDS, head, [head, *rest], "command")
    return _run(COMMANDS, head, rest, "command")

