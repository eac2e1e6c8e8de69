"""``rtrl reconcile``: prove from the topics themselves that nothing was lost or duplicated.

It reads the four topics of the pipeline (read_committed, from the beginning to the end
offsets it sees at start) and accounts for every record:

- every **raw** record is forwarded to the events topic (its ``rtrl-source`` header names
  the raw position), dead-lettered (the DLQ record's ``source`` names it), dropped as a
  duplicate (its ``event_id`` was forwarded from another position), not processed yet (at or
  after the ingest group's committed offset), or else **lost**;
- every ``event_id`` is forwarded at most once (else a **duplicate forwarded event**);
- every request with a ``completion.served`` event has exactly one reward record (two or
  more: **duplicate rewards**); one whose events closed it (an accepted edit with the last
  persistence horizon reported, a rejected edit, a question or an empty completion) or whose
  window is past its due time, but with no reward, is a **lost reward**;
- every event is *reflected* in a reward (its request has one) or in the DLQ. Feedback for
  a request whose served event never came (an *orphan*) and requests still open are
  reported, not counted as lost.

Exit code 0 when nothing is lost or duplicated, 1 otherwise (``--strict``: also when some
event is not reflected yet), 4 when the broker does not answer within ``RTRL_CLI__TIMEOUT_S``
(services/cli/exit_codes.py).

The accounting is the pure function ``reconcile`` (ingest/reward/reconcile.py),
its result a ``Report`` (ingest/reward/reconcile_report.py); this module does the I/O:
:func:`read_inputs` reads the topics, :func:`main` is the command.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from typing import Any

from kafka.errors import KafkaError
from pydantic import ValidationError

from deployer.adapters.group_lag import committed_offsets
from ingest.dedup import SOURCE_HEADER
from ingest.events import parse_event
from ingest.reward.reconcile import (
    UNREADABLE_DLQ,
    UNREADABLE_REWARD,
    DeadLetter,
    ForwardedEvent,
    RawRecord,
    RewardSeen,
    Timing,
    reconcile,
)
from ingest.reward.reconcile_report import Report
from ingest.reward.session_stage import note_wait_s
from ingest.reward.spec import load_spec
from services.cli import exit_codes
from services.cli.backends import BackendUnavailableError, backend_failure, bounded_settings, message
from services.cli.probes import probe_broker
from services.runtime.flags import deprecated_alias
from services.runtime.kafka_io import make_admin, read_topic
from services.settings.model import Settings, get_settings


@dataclass
class Inputs:
    """What :func:`read_inputs` found: the four topics' records and the groups' committed offsets."""

    raw: list[RawRecord]
    forwarded: list[ForwardedEvent]
    dlq: list[DeadLetter]
    rewards: list[RewardSeen]
    ingest_committed: dict[int, int]
    reward_committed: dict[int, int]


def _json(value: bytes | None) -> Any:
    """``value`` parsed as JSON, or None for anything else: a topic may hold any bytes (deep
    nesting, invalid UTF-8, tombstones), and an audit must read past them."""
    if not value:
        return None
    try:
        return json.loads(value)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None


def _raw_event_id(value: bytes | None) -> str | None:
    doc = _json(value)
    eid = doc.get("event_id") if isinstance(doc, dict) else None
    return eid if isinstance(eid, str) else None


def _forwarded(rec: Any) -> ForwardedEvent:
    source = next((v.decode(errors="replace") for k, v in (rec.headers or []) if k == SOURCE_HEADER), None)
    try:
        ev = parse_event(rec.value)
    except (ValidationError, ValueError, TypeError, RecursionError, OverflowError):
        return ForwardedEvent(rec.partition, rec.offset, None, source=source, timestamp_ms=rec.timestamp)
    return ForwardedEvent.of(ev, rec.partition, rec.offset, source, rec.timestamp)


def _dead_letter(rec: Any) -> DeadLetter:
    doc = _json(rec.value)
    src = doc.get("source") if isinstance(doc, dict) else None
    if not isinstance(src, dict):
        return DeadLetter(UNREADABLE_DLQ, None, None, None)
    topic, part, off = src.get("topic"), src.get("partition"), src.get("offset")
    if not (isinstance(topic, str) and _is_int(part) and _is_int(off)):
        return DeadLetter(UNREADABLE_DLQ, None, None, None)
    return DeadLetter(str(doc.get("reason"))[:64], topic, part, off)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def read_inputs(settings: Settings, ingest_group: str | None = None,
                reward_group: str | None = None) -> Inputs:
    """Read the four topics of ``settings.topics`` and the groups' committed offsets.

    Offsets are read first: everything they cover is then on the topics."""
    k, t = settings.kafka, settings.topics
    admin = make_admin(k)
    try:
        ingest_off = committed_offsets(admin, ingest_group or settings.ingest.group_id, t.raw)
        reward_off = committed_offsets(admin, reward_group or settings.reward.group_id, t.events)
    finally:
        admin.close()
    raw = [RawRecord(r.partition, r.offset, _raw_event_id(r.value)) for r in read_topic(k, t.raw)]
    fwd = [_forwarded(r) for r in read_topic(k, t.events)]
    dlq = [_dead_letter(r) for r in read_topic(k, t.dlq)]
    rewards = []
    for r in read_topic(k, t.rewards):
        rid = r.key.decode(errors="replace") if r.key is not None else None
        if rid is None:
            doc = _json(r.value)
            found = doc.get("request_id") if isinstance(doc, dict) else None
            rid = found if isinstance(found, str) else UNREADABLE_REWARD
        rewards.append(RewardSeen(rid, r.partition, r.offset))
    return Inputs(raw, fwd, dlq, rewards, ingest_off, reward_off)


def run(settings: Settings, *, ingest_group: str | None = None, reward_group: str | None = None,
        time_scale: float | None = None, slack_s: float = 60.0, use_offsets: bool = True,
        spec_path: str | None = None) -> Report:
    """Read the topics of ``settings`` and reconcile them (the I/O half of ``rtrl reconcile``)."""
    spec = load_spec(spec_path or settings.reward_spec)
    scale = settings.reward.time_scale if time_scale is None else time_scale
    inp = read_inputs(settings, ingest_group, reward_group)
    timing = Timing(now_ms=int(time.time() * 1000), window_ms=spec.window_s * scale * 1000,
                    followup_ms=spec.window.followup_s * scale * 1000, slack_ms=slack_s * 1000,
                    session_ms=None if spec.session is None
                    else (spec.session.max_s * scale + note_wait_s(spec, scale)) * 1000)
    return reconcile(inp.raw, inp.forwarded, inp.dlq, inp.rewards, raw_topic=settings.topics.raw,
                     max_horizon_s=spec.persistence.max_horizon_s, timing=timing,
                     ingest_committed=inp.ingest_committed if use_offsets else None,
                     reward_committed=inp.reward_committed if use_offsets else None)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="rtrl reconcile",
        description="Account for every record of the raw, events, DLQ and rewards topics: "
                    "report anything lost or duplicated (exit 1).",
        epilog=exit_codes.epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ingest-group", default=None, help="ingest consumer group (default: settings)")
    ap.add_argument("--reward-group", default=None, help="reward consumer group (default: settings)")
    ap.add_argument("--time-scale", type=float, default=None,
                    help="the reward workers' time scale (default: RTRL_REWARD__TIME_SCALE)")
    ap.add_argument("--spec", default=None, help="reward spec TOML (default: settings, else packaged)")
    ap.add_argument("--slack-s", type=float, default=60.0,
                    help="seconds after its due time a missing reward counts as lost (default 60)")
    deprecated_alias(ap, "--slack-seconds", "--slack-s")
    ap.add_argument("--ignore-offsets", action="store_true",
                    help="treat everything as processed (do not read the groups' committed offsets)")
    ap.add_argument("--strict", action="store_true",
                    help="also exit 1 when some event is not reflected in a reward or the DLQ yet")
    ap.add_argument("--json", action="store_true", help="print the full report as JSON")
    args = ap.parse_args(argv)
    settings = bounded_settings(get_settings())
    timeout_s = settings.cli.timeout_s
    try:
        probe_broker(settings)
        rep = run(settings, ingest_group=args.ingest_group, reward_group=args.reward_group,
                  time_scale=args.time_scale, slack_s=args.slack_s,
                  use_offsets=not args.ignore_offsets, spec_path=args.spec)
    except BackendUnavailableError as exc:  # from probe_broker: no broker answered
        print(message("reconcile", exc.failure, settings, timeout_s), file=sys.stderr)
        return exit_codes.UNAVAILABLE
    except KafkaError as exc:
        failure = backend_failure(exc)
        if failure is not None:
            print(message("reconcile", failure, settings, timeout_s), file=sys.stderr)
            return exit_codes.UNAVAILABLE
        print(f"rtrl reconcile: {type(exc).__name__}: {exc} (check RTRL_KAFKA__*)", file=sys.stderr)
        return exit_codes.USAGE
    if args.json:
        print(json.dumps(rep.to_dict(), indent=2, sort_keys=True))
    else:
        t = settings.topics
        print(f"rtrl reconcile: {t.raw} -> {t.events} / {t.dlq} -> {t.rewards}")
        print(rep.render())
    if not rep.ok or (args.strict and not rep.all_reflected):
        return exit_codes.FAILED
    return exit_codes.OK

