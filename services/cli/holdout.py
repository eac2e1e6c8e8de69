"""``rtrl holdout``: the long-term holdout — show it, pin it, rotate it, end it.

``rtrl holdout [status]``                          the holdout and the champion's effect against it
``rtrl holdout pin [VERSION] [--share S] [--days D]``  hold S of the users (default 5%) on VERSION
                                                   (default: the champion) for D days (default 14)
``rtrl holdout rotate [VERSION] [--share S] [--days D]``  new users, new start; VERSION defaults to
                                                   the champion of the moment
``rtrl holdout end``                               everyone back on the champion

Pin, rotate and end are operator commands: signed with the operator's token and executed by the
deployer on its next tick, recorded in the decision ledger (one MLflow run per holdout), like
``rtrl promote`` (services/cli/operator.py). The rules are deployer/holdout.py's; docs/holdout.md
explains what the comparison measures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from collections.abc import Mapping
from typing import Any

from deployer.adapters.reward_tail import read_holdout_report
from deployer.routing import parse_holdout
from deployer.status import Command
from ingest.contracts.keys import routing_key
from services.cli import exit_codes
from services.cli.backends import backend_failure, bound_mlflow_env, bounded_settings, message
from services.cli.operator import _ago, _operator, _redis, _signed, add_signing_args, send
from services.settings.model import Settings, get_settings

SUBCOMMANDS = ("status", "pin", "rotate", "end")
LABELS = {"persistence": "persistence", "latency_ms": "latency (ms)", "dissatisfied": "dissatisfied",
          "reward": "reward", "acceptance": "acceptance"}


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(ts))


def _num(v: Any, pct: bool = False) -> str:
    if not isinstance(v, int | float):
        return "-"
    return f"{v:+.1%}" if pct else (f"{v:.0f}" if abs(v) >= 100 else f"{v:.3f}")


def render(holdout: Mapping[str, Any] | None, report: Mapping[str, Any] | None, now: float) -> str:
    """The ``rtrl holdout`` text (pure)."""
    if holdout is None:
        return "holdout      none pinned (rtrl holdout pin [VERSION] --share 0.05 --days 14)"
    active = holdout["started_at"] <= now < holdout["until"]
    state = "active" if active else "expired (the deployer ends it on its next tick)"
    lines = [f"{'holdout':<13}{holdout['id']}: {holdout['share']:.1%} of users on v{holdout['version']}, "
             f"{_iso(holdout['started_at'])} to {_iso(holdout['until'])}, {state}"]
    if report is None or report.get("holdout_id") != holdout["id"]:
        lines.append(f"{'effect':<13}not measured yet (the deployer measures every "
                     "deployer.holdout_every_s while it runs)")
        return "\n".join(lines)
    users = report.get("users", {})
    lines.append(f"{'compared':<13}champion v{report['champion']} vs holdout v{report['version']} since "
                 f"{_iso(report['since'])}, {users.get('champion', 0):,} vs {users.get('holdout', 0):,} "
                 f"users; measured {_ago(report['at'], now)} ago")
    level = float(report.get("level", 0.99))
    lines += ["", f"{'metric':<16}{'holdout':>10}{'champion':>10}{'change':>9}   "
                  f"{level:.1%} always-valid interval (champion - holdout)"]
    for metric, e in report.get("effects", {}).items():
        interval = f"[{_num(e.get('lower'))}, {_num(e.get('upper'))}]"
        change = _num(e.get("relative"), pct=True)
        figures = f"{_num(e.get('holdout')):>10}{_num(e.get('champion')):>10}{change:>9}"
        lines.append(f"{LABELS.get(metric, metric):<16}{figures}   {interval}")
    return "\n".join(lines)


def _status(settings: Settings, as_json: bool) -> int:
    client = _redis(settings)
    prefix = settings.redis.key_prefix
    holdout, problem = parse_holdout(client.get(routing_key(prefix, "holdout")))
    if problem:
        print(f"warning: {problem}", file=sys.stderr)
    doc = holdout.__dict__ if holdout is not None else None
    report = read_holdout_report(client, prefix)
    if as_json:
        print(json.dumps({"holdout": doc, "report": report if doc is not None else None}, indent=2))
    else:
        print(render(doc, report, time.time()))
    return exit_codes.OK


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="rtrl holdout", epilog=exit_codes.epilog(),
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", nargs="?", default="status", choices=SUBCOMMANDS)
    ap.add_argument("version", nargs="?", default=None, help="pin / rotate: the version to pin "
                    "(default: the champion; any other must have passed the gate)")
    ap.add_argument("--share", type=float, default=None, help="pin / rotate: share of users held out, "
                    "in (0, 0.5] (default 0.05, or the current holdout's)")
    ap.add_argument("--days", type=float, default=None, help="pin / rotate: how long it lasts "
                    "(default 14, or the current holdout's length)")
    ap.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    add_signing_args(ap)
    return ap


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.action in ("status", "end") and (args.version or args.share is not None or args.days is not None):
        print(f"rtrl holdout {args.action} takes no VERSION, --share or --days", file=sys.stderr)
        return exit_codes.USAGE
    settings = bounded_settings(get_settings())
    timeout_s = bound_mlflow_env(settings.cli.timeout_s)
    try:
        if args.action == "status":
            return _status(settings, args.json)
        return _command(settings, args)
    except Exception as exc:
        failure = backend_failure(exc)
        if failure is None:
            raise
        print(message("holdout", failure, settings, timeout_s), file=sys.stderr)
        return exit_codes.UNAVAILABLE


def _command(settings: Settings, args: argparse.Namespace) -> int:
    by = args.by or settings.operators.name or _operator()
    command = Command(id=uuid.uuid4().hex, kind=f"holdout_{args.action}", by=by,  # type: ignore[arg-type]
                      version=args.version, reason=args.reason, share=args.share, days=args.days)
    client = _redis(settings)  # first: with Redis down, its one line is all the operator sees
    code, result = send(settings, _signed(command, settings, args.token_file), args.timeout, client)
    if args.json:
        print(json.dumps({"command": command.kind, "id": command.id, "by": command.by,
                          "version": command.version, "share": command.share, "days": command.days,
                          "result": result, "exit_code": code}, indent=2))
    else:
        print(result)
    return code
