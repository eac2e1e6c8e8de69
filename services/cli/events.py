"""``rtrl events validate FILE.jsonl`` and ``rtrl events schema [--write]``.

For client teams: check a file of events against the v1 contract before sending it. Each
invalid line is reported with its line number and the reasons; the exit code is 1 when any
line is invalid.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pydantic import ValidationError

import ingest
from ingest.events import event_json_schema, parse_event
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
    ok, bad = 0, []
    for n, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            parse_event(raw)
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
        ok += 1
    return ok, bad


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="rtrl events", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("validate", help="validate a JSON-lines file of events ('-' for stdin)")
    v.add_argument("file")
    v.add_argument("--json", action="store_true",
                   help='print one JSON document: {"valid": N, "invalid": [{"line": N, "reason": ...}]}')
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
    ok, bad = validate_lines(data.splitlines())
    if args.json:
        print(json.dumps({"valid": ok, "invalid": [{"line": n, "reason": r} for n, r in bad]}, indent=2))
        return 1 if bad else 0
    for n, reason in bad:
        print(f"line {n}: {reason}")
    print(f"{ok} valid, {len(bad)} invalid")
    return 1 if bad else 0
