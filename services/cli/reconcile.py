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
event is not reflected yet), 2 when the broker does not answer.

The accounting is the pure function :func:`reconcile`; :func:`read_inputs` does the I/O.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from pydantic import ValidationError

from ingest.dedup import SOURCE_HEADER, position_marker
from ingest.events import (
    CompletionServed,
    EditPersistence,
    Event,
    parse_event,
)
from ingest.reward.join import early_close, supersedes

LIST_LIMIT = 20
"""Most ids listed per problem in the text report (the JSON report lists them all)."""


# ---------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class RawRecord:
    """One record of the raw topic: where it is, and its ``event_id`` if it has one."""

    partition: int
    offset: int
    event_id: str | None = None
    """The value's ``event_id`` when it is a JSON object with a string one, else None."""


@dataclass(frozen=True)
class ForwardedEvent:
    """One record of the events topic, reduced to what the accounting needs."""

    partition: int
    offset: int
    event_id: str | None
    """None: the record does not parse as an event (an upstream bug)."""
    request_id: str | None = None
    type: str | None = None
    source: str | None = None
    """The ``rtrl-source`` header: ``<raw topic>:<partition>:<offset>``."""
    timestamp_ms: int = 0
    """Kafka timestamp (when ingest forwarded it)."""
    ts: float = 0.0
    """Producer time (Unix seconds): orders accept/reject decisions as the reward join does."""
    completion_kind: str | None = None
    horizon_s: int | None = None

    @staticmethod
    def of(event: Event, partition: int, offset: int, source: str | None = None,
           timestamp_ms: int = 0) -> ForwardedEvent:
        return ForwardedEvent(
            partition=partition, offset=offset, event_id=event.event_id, request_id=event.request_id,
            type=event.type, source=source, timestamp_ms=timestamp_ms, ts=event.ts.timestamp(),
            completion_kind=event.completion_kind if isinstance(event, CompletionServed) else None,
            horizon_s=event.horizon_s if isinstance(event, EditPersistence) else None,
        )


@dataclass(frozen=True)
class DeadLetter:
    reason: str
    source_topic: str | None
    source_partition: int | None
    source_offset: int | None


@dataclass(frozen=True)
class RewardSeen:
    request_id: str
    partition: int = 0
    offset: int = 0


@dataclass(frozen=True)
class Timing:
    """When a request's reward is due, in the reward service's terms (docs/rewards.md).

    Without a Timing, a request counts as closed only when its events closed it, and
    the reconciler assumes every follow-up wait has passed (an after-the-fact audit)."""

    now_ms: int
    window_ms: float
    """(largest horizon + grace) x time_scale: when an open window closes at the latest."""
    followup_ms: float
    """followup_s x time_scale: the wait after a rejection, a question or an empty completion."""
    slack_ms: float = 60_000
    """Extra time for the reward worker to see the events and commit (lag, restarts)."""


# ---------------------------------------------------------------------- report
@dataclass
class Report:
    raw_records: int = 0
    raw_forwarded: int = 0
    raw_dead_lettered: int = 0
    dead_lettered_by_reason: dict[str, int] = field(default_factory=dict)
    raw_duplicates_dropped: int = 0
    """Raw records whose event_id was forwarded from another position (retries, replays)."""
    raw_pending: int = 0
    """Raw records at or after the ingest group's committed offset (not processed yet)."""
    raw_lost: list[str] = field(default_factory=list)
    """Raw positions ``p:o`` neither forwarded, dead-lettered, dropped nor pending."""
    raw_double_handled: list[str] = field(default_factory=list)
    """Raw positions forwarded more than once, or both forwarded and dead-lettered."""
    dlq_records: int = 0
    dlq_other_source: int = 0
    """DLQ records whose source is not a raw record read here (another topic, retention)."""
    forwarded_events: int = 0
    forwarded_unparseable: int = 0
    forwarded_without_raw: int = 0
    """Forwarded events whose raw source was not read (retention, or written directly)."""
    duplicate_forwarded: dict[str, int] = field(default_factory=dict)
    """event_id -> times forwarded, for those forwarded more than once."""
    requests_served: int = 0
    reward_records: int = 0
    rewarded_requests: int = 0
    duplicate_rewards: dict[str, int] = field(default_factory=dict)
    """request_id -> reward records, for those with more than one."""
    lost_rewards: list[str] = field(default_factory=list)
    """Requests whose reward is due (closed by their events, or past the due time) but absent."""
    open_requests: int = 0
    """Requests (served or not) not due yet, or whose events the reward group has not committed."""
    orphan_requests: list[str] = field(default_factory=list)
    """Requests with feedback events but no served event (never rewarded by design)."""
    rewards_without_events: int = 0
    """Reward records for requests with no event read here (events topic retention)."""
    unreflected_events: int = 0
    """Raw records neither in a reward (through their request) nor in the DLQ nor dropped."""

    @property
    def lost(self) -> int:
        return len(self.raw_lost) + len(self.lost_rewards)

    @property
    def duplicated(self) -> int:
        return len(self.duplicate_forwarded) + len(self.duplicate_rewards) + len(self.raw_double_handled)

    @property
    def all_reflected(self) -> bool:
        return self.unreflected_events == 0

    @property
    def ok(self) -> bool:
        return self.lost == 0 and self.duplicated == 0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(lost=self.lost, duplicated=self.duplicated, all_reflected=self.all_reflected, ok=self.ok)
        return d

    def render(self) -> str:
        def ids(xs: Iterable[str]) -> str:
            xs = list(xs)
            more = f" (+{len(xs) - LIST_LIMIT} more)" if len(xs) > LIST_LIMIT else ""
            return ", ".join(xs[:LIST_LIMIT]) + more

        reasons = ", ".join(f"{k} {v}" for k, v in sorted(self.dead_lettered_by_reason.items())) or "none"
        lines = [
            f"raw records           {self.raw_records}",
            f"  forwarded           {self.raw_forwarded}",
            f"  dead-lettered       {self.raw_dead_lettered}  ({reasons})",
            f"  duplicates dropped  {self.raw_duplicates_dropped}",
            f"  not processed yet   {self.raw_pending}",
            f"  LOST                {len(self.raw_lost)}"
            + (f"  {ids(self.raw_lost)}" if self.raw_lost else ""),
            f"  handled twice       {len(self.raw_double_handled)}"
            + (f"  {ids(self.raw_double_handled)}" if self.raw_double_handled else ""),
            f"forwarded events      {self.forwarded_events}  (unparseable {self.forwarded_unparseable}, "
            f"without a raw record read {self.forwarded_without_raw})",
            f"  DUPLICATE event ids {len(self.duplicate_forwarded)}"
            + (f"  {ids(self.duplicate_forwarded)}" if self.duplicate_forwarded else ""),
            f"dlq records           {self.dlq_records}  (source not among raw records read: "
            f"{self.dlq_other_source})",
            f"served requests       {self.requests_served}",
            f"reward records        {self.reward_records}  for {self.rewarded_requests} requests "
            f"({self.rewards_without_events} without events read)",
            f"  DUPLICATE rewards   {len(self.duplicate_rewards)}"
            + (f"  {ids(f'{k} x{v}' for k, v in self.duplicate_rewards.items())}"
               if self.duplicate_rewards else ""),
            f"  LOST rewards        {len(self.lost_rewards)}"
            + (f"  {ids(self.lost_rewards)}" if self.lost_rewards else ""),
            f"  still open          {self.open_requests}",
            f"  orphan requests     {len(self.orphan_requests)}"
            + (f"  {ids(self.orphan_requests)}" if self.orphan_requests else ""),
            f"every event reflected in a reward or the DLQ: "
            f"{'yes' if self.all_reflected else f'no ({self.unreflected_events} not yet or never)'}",
            f"verdict: {'OK' if self.ok else 'FAILED'}: {self.lost} lost, {self.duplicated} duplicated",
        ]
        return "\n".join(lines)


# ---------------------------------------------------------------------- the accounting
def _close_time_ms(evs: list[ForwardedEvent], timing: Timing | None, max_horizon_s: int) -> float | None:
    """When the request's reward is due (Kafka time of the forwarded events, ms), or None
    when its events did not close it and there is no clock to expire its window. The early
    closes are the reward join's own rules (``ingest.reward.join.early_close``) on Kafka time."""
    served = next((e for e in evs if e.type == "completion.served"), None)
    due = min(e.timestamp_ms for e in evs) + timing.window_ms if timing is not None else None
    decision: tuple[float, bool] | None = None
    decided_ms: float | None = None
    for e in evs:
        if e.type in ("edit.accepted", "edit.rejected"):
            accepted = e.type == "edit.accepted"
            if supersedes(decision, e.ts, accepted):
                decision, decided_ms = (e.ts, accepted), e.timestamp_ms
    final = [e.timestamp_ms for e in evs if e.type == "edit.persistence"
             and e.horizon_s is not None and e.horizon_s >= max_horizon_s]
    early = early_close(
        None if served is None else served.completion_kind,
        None if served is None else served.timestamp_ms,
        decided_ms if decision is not None and not decision[1] else None,
        min(final, default=None), timing.followup_ms if timing is not None else 0.0)
    return min((t for t in (due, early) if t is not None), default=None)


def reconcile(
    raw: Iterable[RawRecord],
    forwarded: Iterable[ForwardedEvent],
    dlq: Iterable[DeadLetter],
    rewards: Iterable[RewardSeen],
    *,
    raw_topic: str,
    max_horizon_s: int = 3600,
    timing: Timing | None = None,
    ingest_committed: Mapping[int, int] | None = None,
    reward_committed: Mapping[int, int] | None = None,
) -> Report:
    """Account for every record of the four topics (see the module doc).

    ``ingest_committed`` / ``reward_committed``: the groups' committed offsets per partition
    of the raw / events topic; records at or after them are *not processed yet* instead of
    lost. None: everything counts as processed (the pipeline is drained)."""
    rep = Report()
    fwd = list(forwarded)
    # -- forwarded events
    by_source: Counter[str] = Counter()
    ids: Counter[str] = Counter()
    by_request: dict[str, list[ForwardedEvent]] = defaultdict(list)
    for f in fwd:
        rep.forwarded_events += 1
        if f.event_id is None or f.request_id is None:
            rep.forwarded_unparseable += 1
            continue
        ids[f.event_id] += 1
        by_request[f.request_id].append(f)
        if f.source is not None:
            by_source[f.source] += 1
    rep.duplicate_forwarded = {k: v for k, v in sorted(ids.items()) if v > 1}
    # -- DLQ
    dlq_at: Counter[str] = Counter()
    dlq_reason: dict[str, str] = {}
    dlq_list = list(dlq)
    rep.dlq_records = len(dlq_list)
    # -- raw records
    raw_list = list(raw)
    raw_positions = {position_marker(raw_topic, r.partition, r.offset) for r in raw_list}
    for d in dlq_list:
        pos = f"{d.source_topic}:{d.source_partition}:{d.source_offset}"  # fields may be missing
        if pos in raw_positions:
            dlq_at[pos] += 1
            dlq_reason[pos] = d.reason
        else:
            rep.dlq_other_source += 1
    rep.forwarded_without_raw = sum(n for s, n in by_source.items() if s not in raw_positions)
    reasons: Counter[str] = Counter()
    rewarded = Counter(r.request_id for r in rewards)
    unreflected_raw = 0
    for r in raw_list:
        pos = position_marker(raw_topic, r.partition, r.offset)
        short = f"{r.partition}:{r.offset}"
        rep.raw_records += 1
        n_fwd, n_dlq = by_source.get(pos, 0), dlq_at.get(pos, 0)
        if n_fwd + n_dlq > 1:
            rep.raw_double_handled.append(short)
        if n_fwd:
            rep.raw_forwarded += 1
        elif n_dlq:
            rep.raw_dead_lettered += 1
            reasons[dlq_reason[pos]] += 1
        elif r.event_id is not None and ids.get(r.event_id, 0) > 0:
            rep.raw_duplicates_dropped += 1
        elif ingest_committed is not None and r.offset >= ingest_committed.get(r.partition, 0):
            rep.raw_pending += 1
            unreflected_raw += 1
        else:
            rep.raw_lost.append(short)
            unreflected_raw += 1
    rep.dead_lettered_by_reason = dict(sorted(reasons.items()))
    # -- rewards per request
    rep.reward_records = sum(rewarded.values())
    rep.rewarded_requests = len(rewarded)
    rep.duplicate_rewards = {k: v for k, v in sorted(rewarded.items()) if v > 1}
    rep.rewards_without_events = sum(1 for k in rewarded if k not in by_request)
    unreflected_fwd = 0
    for rid, evs in sorted(by_request.items()):
        has_served = any(e.type == "completion.served" for e in evs)
        rep.requests_served += has_served
        if rewarded.get(rid, 0) > 0:
            continue
        unreflected_fwd += len(evs)
        processed = reward_committed is None or all(
            e.offset < reward_committed.get(e.partition, 0) for e in evs)
        close = _close_time_ms(evs, timing, max_horizon_s)
        if not has_served and timing is None:
            close = 0.0  # after the fact: the served event never came
        due = processed and close is not None and (
            timing is None or close + timing.slack_ms <= timing.now_ms)
        if not due:
            rep.open_requests += 1
        elif has_served:
            rep.lost_rewards.append(rid)
        else:
            rep.orphan_requests.append(rid)
    rep.unreflected_events = unreflected_raw + unreflected_fwd
    return rep


# ---------------------------------------------------------------------- I/O
@dataclass
class Inputs:
    raw: list[RawRecord]
    forwarded: list[ForwardedEvent]
    dlq: list[DeadLetter]
    rewards: list[RewardSeen]
    ingest_committed: dict[int, int]
    reward_committed: dict[int, int]


def _raw_event_id(value: bytes | None) -> str | None:
    if not value:
        return None
    try:
        doc = json.loads(value)
    except (ValueError, UnicodeDecodeError):
        return None
    eid = doc.get("event_id") if isinstance(doc, dict) else None
    return eid if isinstance(eid, str) else None


def _forwarded(rec: Any) -> ForwardedEvent:
    source = next((v.decode(errors="replace") for k, v in (rec.headers or []) if k == SOURCE_HEADER), None)
    try:
        ev = parse_event(rec.value)
    except (ValidationError, ValueError, TypeError):
        return ForwardedEvent(rec.partition, rec.offset, None, source=source, timestamp_ms=rec.timestamp)
    return ForwardedEvent.of(ev, rec.partition, rec.offset, source, rec.timestamp)


def _dead_letter(rec: Any) -> DeadLetter:
    try:
        doc = json.loads(rec.value)
        src = doc.get("source") or {}
        return DeadLetter(str(doc.get("reason")), src.get("topic"), src.get("partition"), src.get("offset"))
    except (ValueError, TypeError, AttributeError):
        return DeadLetter("unreadable_dlq_record", None, None, None)


def read_inputs(settings: Any, ingest_group: str | None = None, reward_group: str | None = None) -> Inputs:
    """Read the four topics of ``settings.topics`` and the groups' committed offsets.

    Offsets are read first: everything they cover is then on the topics."""
    from services.runtime.kafka_io import committed_offsets, make_admin, read_topic

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
            try:
                rid = str(json.loads(r.value)["request_id"])
            except (ValueError, KeyError, TypeError):
                rid = f"?{r.partition}:{r.offset}"
        rewards.append(RewardSeen(rid, r.partition, r.offset))
    return Inputs(raw, fwd, dlq, rewards, ingest_off, reward_off)


def run(settings: Any, *, ingest_group: str | None = None, reward_group: str | None = None,
        time_scale: float | None = None, slack_s: float = 60.0, use_offsets: bool = True,
        spec_path: str | None = None) -> Report:
    """Read the topics of ``settings`` and reconcile them (the I/O half of ``rtrl reconcile``)."""
    from ingest.reward.spec import load_spec

    spec = load_spec(spec_path or settings.reward_spec)
    scale = settings.reward.time_scale if time_scale is None else time_scale
    inp = read_inputs(settings, ingest_group, reward_group)
    timing = Timing(now_ms=int(time.time() * 1000), window_ms=spec.window_s * scale * 1000,
                    followup_ms=spec.window.followup_s * scale * 1000, slack_ms=slack_s * 1000)
    return reconcile(inp.raw, inp.forwarded, inp.dlq, inp.rewards, raw_topic=settings.topics.raw,
                     max_horizon_s=spec.persistence.max_horizon_s, timing=timing,
                     ingest_committed=inp.ingest_committed if use_offsets else None,
                     reward_committed=inp.reward_committed if use_offsets else None)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="rtrl reconcile",
        description="Account for every record of the raw, events, DLQ and rewards topics: "
                    "report anything lost or duplicated (exit 1).")
    ap.add_argument("--ingest-group", default=None, help="ingest consumer group (default: settings)")
    ap.add_argument("--reward-group", default=None, help="reward consumer group (default: settings)")
    ap.add_argument("--time-scale", type=float, default=None,
                    help="the reward workers' time scale (default: RTRL_REWARD__TIME_SCALE)")
    ap.add_argument("--spec", default=None, help="reward spec TOML (default: settings, else packaged)")
    ap.add_argument("--slack-seconds", type=float, default=60.0,
                    help="how long after its due time a missing reward counts as lost (default 60)")
    ap.add_argument("--ignore-offsets", action="store_true",
                    help="treat everything as processed (do not read the groups' committed offsets)")
    ap.add_argument("--strict", action="store_true",
                    help="also exit 1 when some event is not reflected in a reward or the DLQ yet")
    ap.add_argument("--json", action="store_true", help="print the full report as JSON")
    args = ap.parse_args(argv)
    from kafka.errors import KafkaError

    from services.runtime.kafka_io import wait_for_broker
    from services.runtime.settings import get_settings

    settings = get_settings()
    try:
        wait_for_broker(settings.kafka, timeout_s=30)
        rep = run(settings, ingest_group=args.ingest_group, reward_group=args.reward_group,
                  time_scale=args.time_scale, slack_s=args.slack_seconds,
                  use_offsets=not args.ignore_offsets, spec_path=args.spec)
    except (TimeoutError, KafkaError) as exc:
        print(f"rtrl reconcile: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rep.to_dict(), indent=2, sort_keys=True))
    else:
        t = settings.topics
        print(f"rtrl reconcile: {t.raw} -> {t.events} / {t.dlq} -> {t.rewards}")
        print(rep.render())
    if not rep.ok or (args.strict and not rep.all_reflected):
        return 1
    return 0

