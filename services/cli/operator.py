"""Operator commands for the canary controller: status, history, promote, rollback, pause, resume.

``rtrl status``                    champion, candidate, phase, weight, cohorts, verdict so far
``rtrl history [--limit N]``       the decision ledger (MLflow), newest first
``rtrl promote VERSION``           promote by hand (the running canary, or any gated version)
``rtrl rollback [--to VERSION]``   roll back the running canary, or the champion to VERSION/previous
``rtrl pause`` / ``rtrl resume``   hold / release the canary's weight and promotion
``rtrl approve VERSION``           promote the canary that awaits approval

Manual commands are signed with the operator's token (``RTRL_OPERATORS__TOKEN`` or
``--token-file``) as operator ``--by`` (default ``RTRL_OPERATORS__NAME``, else ``$USER``),
queued in Redis and verified by the controller on its next tick (deployer/operators.py), then
handled through the same state machine and ledger as automatic decisions, with
``decided_by`` = the verified operator. When no controller runs, the command runs one
controller tick itself (holding the controller lease meanwhile).

Every command takes ``--json`` (one JSON document on stdout). Each call to Redis and MLflow
waits at most ``cli.timeout_s`` and is not retried: a backend that is down is one line on
stderr and exit code 4 (services/cli/backends.py, services/cli/exit_codes.py).
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import sys
import time
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from deployer.adapters.webhook import WebhookNotifier
from deployer.ledger import TAG_GATE, iso
from deployer.operators import sign
from deployer.routing import Holdout, parse_holdout
from deployer.status import JUDGED, CanaryStatus, Command
from ingest.contracts.registry import CANDIDATE, CHAMPION, PREVIOUS
from services.cli import exit_codes
from services.cli.backends import backend_failure, bound_mlflow_env, bounded_settings, message, probe_mlflow
from services.runtime.redis_io import make_redis
from services.settings.model import Settings, get_settings
from trainer.adapters.redis_cadence import read_cadence

COHORT_ROWS = ("n", "users", "reward_mean", "acceptance", "persistence", "latency_mean_ms",
               "latency_p95_ms", "dissatisfied_rate", "edit_rate", "invalid_tool_rate", "error_rate")


def _operator() -> str:
    try:
        return os.environ.get("USER") or getpass.getuser() or "operator"
    except (KeyError, OSError):
        return "operator"


def _ago(ts: float, now: float) -> str:
    s = int(max(0.0, now - ts))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _fmt(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 100 or value == int(value) else f"{value:.3f}"


# ---------------------------------------------------------------------------- status
def render_status(status: CanaryStatus, aliases: Mapping[str, str | None], gates: Mapping[str, str],
                  routing: Mapping[str, str | None], holder: str | None, now: float) -> str:
    """The ``rtrl status`` table (pure, so it is tested without any service)."""
    def version(alias: str) -> str:
        v = aliases.get(alias)
        return "-" if v is None else f"v{v}" + (f" (gate {gates[v]})" if gates.get(v) else "")

    phase = status.phase.value + (f" for {_ago(status.phase_since, now)}" if status.phase_since else "")
    weight = float(routing.get("canary_weight") or 0.0)
    stable_v, canary_v = routing.get("stable_version") or "-", routing.get("canary_version") or "-"
    rows = [
        ("champion", version(CHAMPION)),
        ("candidate", version(CANDIDATE)),
        ("previous", version(PREVIOUS)),
        ("phase", phase + ("  [PAUSED]" if status.paused else "")),
        ("canary", f"{status.canary_id or '-'}  v{status.candidate or '-'} vs stable v{status.stable or '-'}"
                   + (f"  step {status.step + 1}" if status.step >= 0 else "")),
        ("weight", f"{weight:.1%} of users on the canary (routing: stable v{stable_v}, canary v{canary_v})"),
        ("verdict", f"{status.verdict or '-'} after {status.ticks} judged ticks"),
        ("controller", holder or "none running (commands run one tick themselves)"),
    ]
    if status.outcome:
        rows.append(("decision", f"{status.outcome} by {status.decided_by}: {status.reason}"))
    if status.note:
        rows.append(("note", status.note))
    if status.handled:
        rows.append(("last command", f"{status.handled[-1][0]}: {status.handled[-1][1]}"))
    lines = [f"{k:<13}{v}" for k, v in rows]
    lines += [f"  - {r}" for r in status.reasons[:6]]
    if status.plan and status.phase in JUDGED:
        lines += ["", *render_plan(status.plan, status.budget_users)]
    if status.cohorts:
        lines += ["", f"{'cohort':<20}{'stable':>12}{'canary':>12}"]
        for key in COHORT_ROWS:
            s, c = status.cohorts.get(f"stable.{key}"), status.cohorts.get(f"canary.{key}")
            if s is not None or c is not None:
                lines.append(f"{key:<20}{_fmt(s) if s is not None else '-':>12}"
                             f"{_fmt(c) if c is not None else '-':>12}")
    return "\n".join(lines)


def _minutes(eta: float | None) -> str:
    return "unknown" if eta is None else "now" if eta <= 0 else f"~{max(1.0, eta / 60):,.0f} min"


def render_plan(plan: Mapping[str, Any], budget_users: int = 0) -> list[str]:
    """The canary's plan (rollback/plan.py): per primary metric, canary users so far against
    what it needs to be decided, and when that comes at the traffic so far; and the canary's
    budget in users (deployer/canary.py), when the plan has set it."""
    budget = f"{budget_users:,} canary users, " if budget_users else ""
    lines = [f"{'plan':<13}{plan.get('users_per_min', 0.0):,.1f} new users/min; every primary metric "
             f"decided in {_minutes(plan.get('eta_s'))} (budget: {budget}"
             f"{plan.get('budget_left_s', 0.0) / 60:,.0f} min left of the time cap)"]
    for mp in plan.get("metrics", ()):
        needed = mp.get("needed")
        want = "decided" if mp.get("decided") else (
            f"{mp['users']:,} of {needed:,} canary users, in {_minutes(mp.get('eta_s'))}"
            if needed is not None else f"{mp['users']:,} canary users, no variance seen yet")
        lines.append(f"  {mp['metric']:<18}{want}")
    if plan.get("warning"):
        lines.append(f"  ! {plan['warning']}")
    return lines


def render_history(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no canaries recorded yet"
    out = [f"{'started (UTC)':<18}{'canary':<38}{'decision':<10}{'by':<12}reason"]
    for r in rows:
        started = datetime.fromtimestamp((r["started_ms"] or 0) / 1000, UTC).strftime("%Y-%m-%d %H:%M")
        reason = (r["reason"] or r["outcome"] or "running")[:90]
        out.append(f"{started:<18}{r['canary_id']:<38}{r['decision'] or '-':<10}{r['decided_by'] or '-':<12}"
                   f"{reason}")
    return "\n".join(out)


def _status(settings: Settings, as_json: bool) -> int:
    from services.wiring.deployer import build_ports  # heavy: after Redis answered

    client = _redis(settings)
    ports = build_ports(settings, redis_client=client)
    status, holder = ports.state.load(), ports.state.holder()
    routing = ports.routing.read()
    aliases: dict[str, str | None] = {}
    gates: dict[str, str] = {}
    registry_error = None
    try:
        aliases = {a: ports.registry.alias_version(a) for a in (CHAMPION, CANDIDATE, PREVIOUS)}
        for v in {x for x in aliases.values() if x}:
            gates[v] = ports.registry.get_tags(v).get(TAG_GATE, "")
    except Exception as exc:  # show what Redis knows even when MLflow is down, then exit 4
        failure = backend_failure(exc)
        if failure is None:
            raise
        registry_error = message("status", failure, settings, bound_mlflow_env(settings.cli.timeout_s))
        print(registry_error, file=sys.stderr)
    engine = ports.engine.describe() if ports.engine is not None else None
    trainer = read_cadence(client, settings.redis.key_prefix)
    holdout = parse_holdout(routing.get("holdout"))[0]
    if as_json:
        print(json.dumps({"status": status.to_json(), "aliases": aliases, "gates": gates,
                          "routing": routing, "controller": holder, "engine": engine,
                          "trainer": trainer, "holdout": holdout.__dict__ if holdout else None,
                          "registry_error": registry_error}, indent=2))
    else:
        print(render_status(status, aliases, gates, routing, holder, time.time()))
        print(render_trainer(trainer, time.time()))
        print(render_holdout(holdout, time.time()))
        if engine is not None:
            print(render_engine(engine, routing))
    return exit_codes.OK if registry_error is None else exit_codes.UNAVAILABLE


def render_trainer(cadence: Mapping[str, Any] | None, now: float) -> str:
    """The trainer service's last cadence decision: starting, or waiting and for what."""
    if cadence is None:
        return f"{'trainer':<13}no trainer service has reported in the last minutes"
    what = "starting an increment" if cadence.get("start") else "waiting"
    at = cadence.get("at")
    when = f" ({_ago(float(at), now)} ago)" if isinstance(at, int | float) else ""
    figures = (f"{cadence.get('records', 0)} records since the last window, effective sample size "
               f"{float(cadence.get('ess', 0.0)):.0f}")
    return "\n".join([f"{'trainer':<13}{what}{when}: {cadence.get('reason', '')}", f"{'':<13}{figures}"])


def render_holdout(h: Holdout | None, now: float) -> str:
    """One line on the long-term holdout (``rtrl holdout`` shows its effect)."""
    if h is None:
        return f"{'holdout':<13}none pinned"
    state = f"until {iso(h.until)}" if h.active(now) else f"expired at {iso(h.until)}"
    return f"{'holdout':<13}{h.id}: {h.share:.1%} of users on v{h.version}, {state} (rtrl holdout)"


def render_engine(engine: Mapping[str, Any], routing: Mapping[str, str | None]) -> str:
    """What the inference engine has loaded, and the model name each arm is served as."""
    versions: Mapping[str, Mapping[str, str]] = engine.get("versions", {})
    models = engine.get("engine_models")
    listed = ", ".join(models) if isinstance(models, list) else str(models)
    lines = ["", f"{'engine':<13}{engine.get('base_url')}  (serving: {listed or 'nothing'})"]
    held = parse_holdout(routing.get("holdout"))[0]
    for arm, v in (("stable", routing.get("stable_version")), ("canary", routing.get("canary_version")),
                   ("holdout", held.version if held else None)):
        if arm == "holdout" and v is None:
            continue
        st = versions.get(v or "", {})
        where = st.get("model") or ("-" if v is None else "not loaded")
        lines.append(f"{arm:<13}v{v or '-'} as {where}" + (f"  [{st['state']}]" if st else ""))
    for v, st in versions.items():
        if st.get("state") == "failed":
            lines.append(f"{'failed':<13}v{v}: {st.get('reason', '')}")
    return "\n".join(lines)


def _history(settings: Settings, limit: int, as_json: bool) -> int:
    from deployer.adapters.ledger_mlflow import MlflowLedger

    rows = MlflowLedger(settings.mlflow.tracking_uri, settings.mlflow.deployments_experiment).history(limit)
    print(json.dumps(rows, indent=2) if as_json else render_history(rows))
    return 0


# ---------------------------------------------------------------------------- commands
def _redis(settings: Settings) -> Any:
    """A Redis client whose calls wait at most ``cli.timeout_s`` and are not retried; pinged
    here so a Redis that is down is reported before MLflow's slow import."""
    client = make_redis(settings.redis, settings.cli.timeout_s)
    client.ping()
    return client


def send(settings: Settings, command: Command, timeout_s: float, redis_client: Any = None) -> tuple[int, str]:
    """Queue ``command`` and wait for its result; run a tick here when no controller runs."""
    from services.wiring.deployer import build_controller, build_ports, reward_reader  # heavy

    ports = build_ports(settings, owner=f"cli-{command.by}-{command.id}", redis_client=redis_client)
    ports.state.push(command)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = dict(ports.state.load().handled).get(command.id)
        if result is not None:
            failed = result.startswith(("rejected", "refused"))
            return (exit_codes.FAILED if failed else exit_codes.OK), result
        if ports.state.holder() is None:
            rewards = None
            try:
                rewards = reward_reader(settings)
            except Exception as exc:  # the command still runs; a canary then sees an error tick
                print(f"warning: rewards topic unavailable ({exc})", file=sys.stderr)
            try:
                build_controller(settings, ports, rewards).step()
            finally:
                ports.state.release()
                if isinstance(ports.notifier, WebhookNotifier):  # deliver before the CLI exits
                    ports.notifier.close(timeout_s=settings.notify.timeout_s * (settings.notify.retries + 1))
                if rewards is not None:
                    rewards.close()
            continue
        time.sleep(0.2)
    return exit_codes.NOT_DONE, (f"queued as {command.id}; the controller ({ports.state.holder()}) has "
                                 f"not handled it within {timeout_s:g}s")


def _signed(command: Command, settings: Settings, source: str | None) -> Command:
    """``command`` signed with the operator's token (read from the file ``source``, ``-`` for
    stdin, else the settings); unsigned, with a warning, without one."""
    if source is not None:
        token = (sys.stdin.read() if source == "-" else Path(source).read_text()).strip()
    else:
        token = settings.operators.token.get_secret_value() if settings.operators.token else ""
    if not token:
        print("warning: no operator token (RTRL_OPERATORS__TOKEN or --token-file): the deployer "
              "refuses unsigned commands unless operators.allow_unauthenticated", file=sys.stderr)
        return command
    return sign(command, token, time.time())


def _parser(name: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=f"rtrl {name}", epilog=exit_codes.epilog(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    if name in ("status", "history"):
        if name == "history":
            ap.add_argument("--limit", type=int, default=20, help="most recent canaries to show")
        return ap
    if name == "promote":
        ap.add_argument("version", help="model version to promote (needs rtrl.gate.result=pass)")
    if name == "approve":
        ap.add_argument("version", help="the version awaiting approval")
    if name == "rollback":
        ap.add_argument("--to", dest="version", default=None,
                        help="with no canary running: the version to restore (default: previous)")
    add_signing_args(ap)
    return ap


def add_signing_args(ap: argparse.ArgumentParser) -> None:
    """The options of every signed operator command: who, the token, why, how long to wait."""
    ap.add_argument("--by", default=None, help="operator name to sign as (default: RTRL_OPERATORS__NAME, "
                    "else $USER); recorded in the ledger")
    ap.add_argument("--token-file", default=None, help="file holding the operator token ('-': stdin; "
                    "default: RTRL_OPERATORS__TOKEN)")
    ap.add_argument("--reason", default="", help="why; recorded in the ledger")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the controller")


def main(argv: list[str]) -> int:
    """``argv[0]`` is the command name (status, history, promote, rollback, pause, resume, approve)."""
    if not argv or argv[0] not in ("status", "history", "promote", "rollback", "pause", "resume", "approve"):
        print(__doc__, file=sys.stderr)
        return exit_codes.USAGE
    name, args = argv[0], _parser(argv[0]).parse_args(argv[1:])
    settings = bounded_settings(get_settings())
    timeout_s = bound_mlflow_env(settings.cli.timeout_s)
    try:
        return _run(name, args, settings)
    except Exception as exc:
        failure = backend_failure(exc)
        if failure is None:
            raise
        print(message(name, failure, settings, timeout_s), file=sys.stderr)
        return exit_codes.UNAVAILABLE


def _run(name: str, args: argparse.Namespace, settings: Settings) -> int:
    if name == "status":
        return _status(settings, args.json)
    if name == "history":
        probe_mlflow(settings.mlflow.tracking_uri, settings.cli.timeout_s)
        return _history(settings, args.limit, args.json)
    by = args.by or settings.operators.name or _operator()
    command = Command(id=uuid.uuid4().hex, kind=name, by=by,  # type: ignore[arg-type]
                      version=getattr(args, "version", None), reason=args.reason)
    client = _redis(settings)  # first: with Redis down, its one line is all the operator sees
    code, result = send(settings, _signed(command, settings, args.token_file), args.timeout, client)
    if args.json:
        print(json.dumps({"command": name, "id": command.id, "by": command.by, "version": command.version,
                          "result": result, "exit_code": code}, indent=2))
    else:
        print(result)
    return code
