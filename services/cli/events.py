"""``rtrl events validate FILE.jsonl [--sessions]`` and ``rtrl events schema [--write]``.

For client teams: check a file of events against the v1 contract before sending it. Each
invalid line is reported with its line number and the reasons; the exit code is 1 when any
line is invalid. ``--sessions`` also assembles the file's sessions from their valid events
(ingest/reward/sessions.py) as of the file's latest ``ts`` and reports each session's status
and anomalies; any anomaly makes the exit code 1 too.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pydantic import ValidationError

import ingest
from ingest.events import Event, SessionEvent, event_json_schema, parse_event
from ingest.reward.sessions import Session, SessionWindow, assemble_all
from ingest.validate import duplicate_key

SCHEMA_PATH = Path(ingest.__file__).resolve().parent / "schema" / "events.v1.json"


def render_schema() -> str:
    return json.dumps(event_json_schema(), indent=2, sort_keys=True) + "\n"


def describe_error(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors(include_url=False):
        loc = ".".join(str(p) for p in err["loc"]) or "(event)"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


def validate_lines(lines: list[bytes]) -> tuple[int, list[tuple[int, str]]]:
    """Return (valid count, [(line number, reason)]) for non-blank lines."""
    valid, bad = parse_lines(lines)
    return len(valid), bad


def parse_lines(lines: list[bytes]) -> tuple[list[Event], list[tuple[int, str]]]:
    """Return ([valid event], [(line number, reason)]) for non-blank lines."""
    ok: list[Event] = []
    bad: list[tuple[int, str]] = []
    for n, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            event = parse_event(raw)
        except ValidationError as exc:
            bad.append((n, describe_error(exc)))
            continue
        except Exception as exc:  # any input gets a line-numbered report, never a traceback
            bad.append((n, f"unreadable ({type(exc).__name__})"))
            continue
        repeated = duplicate_key(raw)
        if repeated is not None:
            bad.append((n, f"an object names the key {repeated[:64]!r} more than once"))
            continue
        ok.append(event)
    return ok, bad


def file_sessions(events: list[Event], window: SessionWindow) -> dict[str, Session]:
    """The sessions of a file's valid events, assembled as of their latest ``ts``."""
    session_events = [e for e in events if isinstance(e, SessionEvent)]
    if not session_events:
        return {}
    return assemble_all(session_events, max(e.ts for e in session_events), window)


def session_doc(s: Session) -> dict[str, object]:
    return {"session_id": s.session_id, "status": s.status, "turns": len(s.turns),
            "set_aside": len(s.set_aside),
            "anomalies": [{"code": a.code, "detail": a.detail, "event_id": a.event_id} for a in s.anomalies]}


def _print_sessions(sessions: dict[str, Session]) -> None:
    for s in sessions.values():
        print(f"session {s.session_id}: {s.status}, {len(s.turns)} turn{'' if len(s.turns) == 1 else 's'}")
        for a in s.anomalies:
            about = f" (event {a.event_id})" if a.event_id is not None else ""
            print(f"  {a.code}{about}: {a.detail}")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="rtrl events", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("validate", help="validate a JSON-lines file of events ('-' for stdin)")
    v.add_argument("file")
    v.add_argument("--json", action="store_true",
                   help='print one JSON document: {"valid": N, "invalid": [{"line": N, "reason": ...}]}')
    v.add_argument("--sessions", action="store_true",
                   help="also check each session's events together (turn order, tool calls, summaries, "
                        "end) as of the file's latest ts; anomalies make the exit code 1")
    v.add_argument("--idle-s", type=float, default=SessionWindow.idle_s,
                   help="with --sessions: a session without an end times out after this idle time")
    v.add_argument("--max-turns", type=int, default=SessionWindow.max_turns,
                   help="with --sessions: more turns than this is an anomaly")
    s = sub.add_parser("schema", help="print the JSON Schema (v1)")
    s.add_argument("--write", action="store_true", help=f"write it to {SCHEMA_PATH.name}")
    args = ap.parse_args(argv)
    if args.cmd == "schema":
        if args.write:
            SCHEMA_PATH.write_text(render_schema())
            print(f"wrote {SCHEMA_PATH}")
        else:
            sys.stdout.write(render_schema())
        return 0
    try:
        data = sys.stdin.buffer.read() if args.file == "-" else Path(args.file).read_bytes()
    except OSError as exc:
        print(f"rtrl events: cannot read {args.file}: {exc.strerror}", file=sys.stderr)
        return 2
    valid, bad = parse_lines(data.splitlines())
    window = SessionWindow(idle_s=args.idle_s, max_turns=args.max_turns)
    sessions = file_sessions(valid, window) if args.sessions else {}
    failed = 1 if bad or any(s.anomalies for s in sessions.values()) else 0
    if args.json:
        doc: dict[str, object] = {"valid": len(valid), "invalid": [{"line": n, "reason": r} for n, r in bad]}
        if args.sessions:
            doc["sessions"] = [session_doc(s) for s in sessions.values()]
        print(json.dumps(doc, indent=2))
        return failed
    for n, reason in bad:
        print(f"line {n}: {reason}")
    print(f"{len(valid)} valid, {len(bad)} invalid")
    _print_sessions(sessions)
    return failed
