"""The accounting of ``rtrl reconcile`` (services/cli/reconcile.py): a pure function of the
four topics' records, so it is tested on hand-built topic contents.

:func:`reconcile` accounts in four steps, each a named function: the forwarded events
(:func:`tally_forwarded`), the DLQ (:func:`tally_dead_letters`), the raw records
(:func:`account_raw`) and the rewards per request (:func:`account_requests`). The rules
each applies are in the module doc of services/cli/reconcile.py.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from ingest.dedup import position_marker
from ingest.events import CompletionServed, EditPersistence, Event
from ingest.reward.join import early_close, supersedes
from ingest.reward.reconcile_report import Report


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


UNREADABLE_DLQ = "unreadable_dlq_record"
"""The reason of a DLQ record that is not a DLQ record of this format (any bytes)."""
UNREADABLE_REWARD = "?"
"""The request id of a rewards record with neither a key nor a readable ``request_id``."""


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
    session_ms: float | None = None
    """Under a spec with a ``[session]`` table: (max_s x time_scale + the session stage's note
    wait): a session turn's record comes when its session closes, at the latest this long after
    the turn's first event."""


# ---------------------------------------------------------------------- the four steps
@dataclass(frozen=True)
class ForwardedTally:
    records: int
    unparseable: int
    by_source: Counter[str]
    """``rtrl-source`` raw position -> events forwarded from it."""
    ids: Counter[str]
    """event_id -> times forwarded."""
    by_request: dict[str, list[ForwardedEvent]]
    """request_id -> its parseable forwarded events, in topic order."""


def tally_forwarded(forwarded: Iterable[ForwardedEvent]) -> ForwardedTally:
    """Count the events topic by source position, event id and request."""
    records = unparseable = 0
    by_source: Counter[str] = Counter()
    ids: Counter[str] = Counter()
    by_request: dict[str, list[ForwardedEvent]] = defaultdict(list)
    for f in forwarded:
        records += 1
        if f.event_id is None or f.request_id is None:
            unparseable += 1
            continue
        ids[f.event_id] += 1
        by_request[f.request_id].append(f)
        if f.source is not None:
            by_source[f.source] += 1
    return ForwardedTally(records, unparseable, by_source, ids, by_request)


@dataclass(frozen=True)
class DeadLetterTally:
    records: int
    other_source: int
    """DLQ records whose source is not a raw record read here."""
    at: Counter[str]
    """Raw position -> DLQ records naming it."""
    reason: dict[str, str]
    """Raw position -> the reason of the last DLQ record naming it."""


def tally_dead_letters(dlq: list[DeadLetter], raw_positions: set[str]) -> DeadLetterTally:
    """Count the DLQ by the raw position each record names."""
    at: Counter[str] = Counter()
    reason: dict[str, str] = {}
    other = 0
    for d in dlq:
        pos = f"{d.source_topic}:{d.source_partition}:{d.source_offset}"  # fields may be missing
        if pos in raw_positions:
            at[pos] += 1
            reason[pos] = d.reason
        else:
            other += 1
    return DeadLetterTally(len(dlq), other, at, reason)


RawFate = Literal["forwarded", "dead_lettered", "dropped", "pending", "lost"]


def raw_fate(r: RawRecord, n_forwarded: int, n_dead: int, ids: Mapping[str, int],
             ingest_committed: Mapping[int, int] | None) -> RawFate:
    """What became of one raw record, given how often it was forwarded and dead-lettered."""
    if n_forwarded:
        return "forwarded"
    if n_dead:
        return "dead_lettered"
    if r.event_id is not None and ids.get(r.event_id, 0) > 0:
        return "dropped"  # its event_id was forwarded from another position
    if ingest_committed is not None and r.offset >= ingest_committed.get(r.partition, 0):
        return "pending"
    return "lost"


@dataclass(frozen=True)
class RawAccount:
    fates: Counter[str]
    """RawFate -> raw records."""
    dead_lettered_by_reason: dict[str, int]
    lost: list[str]
    double_handled: list[str]


def account_raw(raw: list[RawRecord], raw_topic: str, fwd: ForwardedTally, dead: DeadLetterTally,
                ingest_committed: Mapping[int, int] | None) -> RawAccount:
    """The fate of every raw record, and those handled more than once."""
    fates: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    lost: list[str] = []
    twice: list[str] = []
    for r in raw:
        pos = position_marker(raw_topic, r.partition, r.offset)
        short = f"{r.partition}:{r.offset}"
        n_fwd, n_dlq = fwd.by_source.get(pos, 0), dead.at.get(pos, 0)
        if n_fwd + n_dlq > 1:
            twice.append(short)
        fate = raw_fate(r, n_fwd, n_dlq, fwd.ids, ingest_committed)
        fates[fate] += 1
        if fate == "dead_lettered":
            reasons[dead.reason[pos]] += 1
        elif fate == "lost":
            lost.append(short)
    return RawAccount(fates, dict(sorted(reasons.items())), lost, twice)


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
    close = min((t for t in (due, early) if t is not None), default=None)
    if timing is not None and timing.session_ms is not None and any(e.type == "session.turn" for e in evs):
        return min(e.timestamp_ms for e in evs) + timing.session_ms  # credited when its session closes
    return close


def unrewarded_fate(evs: list[ForwardedEvent], timing: Timing | None, max_horizon_s: int,
                    reward_committed: Mapping[int, int] | None) -> Literal["open", "lost", "orphan"]:
    """A request without a reward: still open (not due, or its events not committed by the
    reward group), a lost reward, or an orphan (feedback whose served event never came)."""
    has_served = any(e.type == "completion.served" for e in evs)
    processed = reward_committed is None or all(
        e.offset < reward_committed.get(e.partition, 0) for e in evs)
    close = _close_time_ms(evs, timing, max_horizon_s)
    if not has_served and timing is None:
        close = 0.0  # after the fact: the served event never came
    due = processed and close is not None and (
        timing is None or close + timing.slack_ms <= timing.now_ms)
    if not due:
        return "open"
    return "lost" if has_served else "orphan"


@dataclass(frozen=True)
class RequestAccount:
    served: int
    lost_rewards: list[str]
    open_requests: int
    orphans: list[str]
    unreflected_events: int
    """Forwarded events of requests without a reward."""


def account_requests(by_request: Mapping[str, list[ForwardedEvent]], rewarded: Mapping[str, int],
                     timing: Timing | None, max_horizon_s: int,
                     reward_committed: Mapping[int, int] | None) -> RequestAccount:
    """Judge every request of the events topic that has no reward, in request id order."""
    served = open_requests = unreflected = 0
    lost: list[str] = []
    orphans: list[str] = []
    for rid, evs in sorted(by_request.items()):
        served += any(e.type == "completion.served" for e in evs)
        if rewarded.get(rid, 0) > 0:
            continue
        unreflected += len(evs)
        fate = unrewarded_fate(evs, timing, max_horizon_s, reward_committed)
        if fate == "open":
            open_requests += 1
        elif fate == "lost":
            lost.append(rid)
        else:
            orphans.append(rid)
    return RequestAccount(served, lost, open_requests, orphans, unreflected)


# ---------------------------------------------------------------------- the accounting
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
    """Account for every record of the four topics (see services/cli/reconcile.py).

    ``ingest_committed`` / ``reward_committed``: the groups' committed offsets per partition
    of the raw / events topic; records at or after them are *not processed yet* instead of
    lost. None: everything counts as processed (the pipeline is drained)."""
    fwd = tally_forwarded(forwarded)
    dlq_list = list(dlq)
    raw_list = list(raw)
    raw_positions = {position_marker(raw_topic, r.partition, r.offset) for r in raw_list}
    dead = tally_dead_letters(dlq_list, raw_positions)
    raw_acc = account_raw(raw_list, raw_topic, fwd, dead, ingest_committed)
    reward_list = list(rewards)
    rewarded = Counter(r.request_id for r in reward_list if r.request_id != UNREADABLE_REWARD)
    req = account_requests(fwd.by_request, rewarded, timing, max_horizon_s, reward_committed)
    return Report(
        raw_records=len(raw_list),
        raw_forwarded=raw_acc.fates["forwarded"],
        raw_dead_lettered=raw_acc.fates["dead_lettered"],
        dead_lettered_by_reason=raw_acc.dead_lettered_by_reason,
        raw_duplicates_dropped=raw_acc.fates["dropped"],
        raw_pending=raw_acc.fates["pending"],
        raw_lost=raw_acc.lost,
        raw_double_handled=raw_acc.double_handled,
        dlq_records=dead.records,
        dlq_other_source=dead.other_source,
        dlq_unreadable=sum(1 for d in dlq_list if d.reason == UNREADABLE_DLQ),
        forwarded_events=fwd.records,
        forwarded_unparseable=fwd.unparseable,
        forwarded_without_raw=sum(n for s, n in fwd.by_source.items() if s not in raw_positions),
        duplicate_forwarded={k: v for k, v in sorted(fwd.ids.items()) if v > 1},
        requests_served=req.served,
        reward_records=sum(rewarded.values()),
        rewarded_requests=len(rewarded),
        duplicate_rewards={k: v for k, v in sorted(rewarded.items()) if v > 1},
        lost_rewards=req.lost_rewards,
        open_requests=req.open_requests,
        orphan_requests=req.orphans,
        rewards_without_events=sum(1 for k in rewarded if k not in fwd.by_request),
        rewards_unreadable=sum(1 for r in reward_list if r.request_id == UNREADABLE_REWARD),
        unreflected_events=raw_acc.fates["pending"] + raw_acc.fates["lost"] + req.unreflected_events,
    )
