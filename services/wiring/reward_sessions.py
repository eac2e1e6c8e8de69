"""The reward worker's session stage: agent sessions credited per turn, exactly once.

Runs only under a reward spec with a ``[session]`` table (docs/rewards.md, "Sessions: how
the worker joins them"). Two halves:

- **In the per-request stage** (services/wiring/reward.py): every consumed session event is
  forwarded to ``topics.sessions`` keyed by its ``session_id``, and the window of a request
  that a ``session.turn`` claimed closes into a :class:`TurnNote` there instead of a reward
  record; both go in the transaction that commits the consumed events' offsets.
- **The session stage** (:class:`SessionStage`): a second exactly-once loop in the same
  process, in its own consumer group on ``topics.sessions``, where all of a session is on
  one partition. Per batch it stores the session's events and notes in Redis (first write
  wins), looks at the sessions due (``ingest.reward.session_stage.decide``) and emits their
  records to the rewards topic (each on its request's partition) with a :class:`Credited`
  marker on its own partition, in one transaction with the consumed offsets. Once committed
  it marks the handled request ids in Redis and drops the session's state. A crash between
  the commit and the marks is repaired as the per-request stage repairs its own: on every
  assignment the stage reads its partitions' committed markers back from a checkpoint.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kafka import TopicPartition
from pydantic import ValidationError

from ingest.adapters.committed_tail import CommittedTail
from ingest.adapters.redis_sessions import Handled, RedisSessionState, Touch
from ingest.contracts import prometheus as m
from ingest.events import Event, RewardRecord, SessionEvent, SessionTurn
from ingest.reward.join import Closed as ClosedWindow
from ingest.reward.join import Window
from ingest.reward.session_stage import (
    Credited,
    ForwardedEvent,
    TurnNote,
    decide,
    late_note_records,
    note_facts,
    parse_message,
)
from ingest.reward.spec import RewardSpec
from services.runtime.exactly_once import Batch, Output
from services.settings.model import Settings

log = logging.getLogger("rtrl.reward.sessions")
GAUGES_EVERY_S = 2.0
MARKER_IDS = 1000
"""Request ids per Credited marker (at most 128 characters each: a marker stays under 150 kB)."""


# ---------------------------------------------------------------- the per-request stage's half
def forward(events: Sequence[Event], topic: str) -> list[Output]:
    """Every session event of a batch, re-keyed by its session."""
    return [Output(topic, ForwardedEvent(event=ev).model_dump_json().encode(), ev.session_id.encode())
            for ev in events if isinstance(ev, SessionEvent)]


def turn_notes(w: Window, closed: ClosedWindow, partition: int, spec: RewardSpec, topic: str) -> list[Output]:
    """A claimed request's window, closed: the first claiming session gets its record and
    facts (when served), every later claimer a note without."""
    out = []
    for i, sid in enumerate(w.sessions):
        rec: RewardRecord | None = closed.record if i == 0 else None
        note = TurnNote(session_id=sid, request_id=w.request_id, partition=partition, record=rec,
                        facts=note_facts(w, spec) if rec is not None else None)
        out.append(Output(topic, note.model_dump_json().encode(), sid.encode()))
    return out


def late_turn_notes(late: Sequence[Event], partition_of: Mapping[str, int], topic: str) -> list[Output]:
    """A ``session.turn`` for a request whose per-request record is already out: its session
    gets a note without a record (the turn is not credited, its request has its reward)."""
    return [Output(topic, TurnNote(session_id=ev.session_id, request_id=ev.request_id,
                                   partition=partition_of.get(ev.request_id, 0)).model_dump_json().encode(),
                   ev.session_id.encode())
            for ev in late if isinstance(ev, SessionTurn)]


# ---------------------------------------------------------------- the session stage
@dataclass
class StageResult:
    handled: list[Handled] = field(default_factory=list)
    statuses: list[str] = field(default_factory=list)
    """How each session credited in the batch closed."""
    rewards: list[tuple[str, float, bool]] = field(default_factory=list)
    """(arm, reward, defaulted) of every record emitted."""


class SessionStage:
    """The session stage as the exactly-once loop's transform (module doc)."""

    def __init__(self, settings: Settings, spec: RewardSpec, store: RedisSessionState,
                 tail: CommittedTail) -> None:
        if spec.session is None:
            raise ValueError("the session stage needs a reward spec with a [session] table")
        self.topics = settings.topics
        self.cfg = settings.reward
        self.spec = spec
        self.store = store
        self.tail = tail
        self.pending_recovery: set[int] = set()
        self.limit = max(1, self.cfg.max_close_per_batch // 20)
        """Sessions closed per transaction at most."""
        self._last_gauges = 0.0

    def recover(self, partitions: Sequence[TopicPartition]) -> None:
        self.pending_recovery.update(tp.partition for tp in partitions if tp.topic == self.topics.sessions)

    def transform(self, polled: Mapping[TopicPartition, Sequence[Any]],
                  assigned: Sequence[TopicPartition]) -> Batch[StageResult]:
        owned = sorted(tp.partition for tp in assigned if tp.topic == self.topics.sessions)
        self.pending_recovery &= set(owned)
        if self.pending_recovery:
            self._recover(sorted(self.pending_recovery))
        now = time.time()
        touched, markers = _decode(polled)
        if markers:
            self.store.finish(markers)  # our own markers, read back: idempotent
        result, outputs = StageResult(), list[Output]()
        done = self.store.handled(touched)
        for sid in [s for s in touched if s in done]:
            self._late(touched.pop(sid), sid, done[sid], result, outputs)
        self.store.apply(touched, now, self.spec, self.cfg.time_scale)
        ready = [p for p in owned if p not in self.pending_recovery]
        rows, next_at = self.store.due(ready, now, self.limit)
        later: list[tuple[int, str, float | None]] = []
        for p, sid in rows:
            if len(outputs) >= self.cfg.max_close_per_batch:  # the rest in the next transaction
                next_at = now
                break
            state = self.store.load(sid)
            d = decide(state, now, self.spec, self.cfg.time_scale)
            if d.records is None:  # still open; no time at all: a timer left without a session
                later.append((p, sid, d.next_at))
                continue
            outputs += [self._record(r, state.notes[r.request_id].partition, result) for r in d.records]
            outputs += self._markers(p, sid, d.handled, closed=True)
            result.handled.append(Handled(p, sid, d.handled, closed=True))
            result.statuses.append("open" if d.session is None else d.session.status)
            if d.missing:
                log.warning("session credited without %d turns whose facts never came", len(d.missing))
        self.store.reschedule(later)
        times = [t for _, _, t in later if t is not None] + ([next_at] if next_at is not None else [])
        if now - self._last_gauges >= GAUGES_EVERY_S:
            self._last_gauges = now
            m.REWARD_OPEN_SESSIONS.set(self.store.open_count(owned))
        return Batch(outputs, result, wake_at=min(times, default=None))

    def committed(self, batch: Batch[StageResult], delivered: Sequence[Any]) -> None:
        ckpts: dict[int, int] = {}
        for meta in delivered:
            if meta.topic == self.topics.sessions:
                ckpts[meta.partition] = max(ckpts.get(meta.partition, 0), meta.offset + 1)
        self.store.finish(batch.result.handled, ckpts)
        for status in batch.result.statuses:
            m.REWARD_SESSIONS_CLOSED.labels(status).inc()
        m.REWARD_SESSION_TURNS.inc(len(batch.result.rewards))
        for arm, reward, defaulted in batch.result.rewards:
            m.REWARDS_EMITTED.labels(arm, str(defaulted).lower()).inc()
            m.observe_reward(arm, reward)

    def _late(self, t: Touch, sid: str, handled: set[str], result: StageResult,
              outputs: list[Output]) -> None:
        """Messages for a session already credited: events are late (counted); a note not
        handled yet gets its request's own record once."""
        if t.events:
            m.REWARD_LATE.labels("session").inc(len(t.events))
        records, ids = late_note_records(t.notes, handled)
        if not ids:
            return
        by_rid = {n.request_id: n.partition for n in t.notes}
        outputs += [self._record(r, by_rid[r.request_id], result) for r in records]
        outputs += self._markers(t.partition, sid, tuple(ids), closed=False)
        result.handled.append(Handled(t.partition, sid, tuple(ids), closed=False))

    def _record(self, rec: RewardRecord, partition: int, result: StageResult) -> Output:
        result.rewards.append((rec.arm, rec.reward, rec.defaulted))
        return Output(self.topics.rewards, rec.model_dump_json().encode(), rec.request_id.encode(),
                      partition=partition)

    def _markers(self, partition: int, sid: str, ids: Sequence[str], closed: bool) -> list[Output]:
        """The session's Credited markers, ``MARKER_IDS`` request ids each (a 10,000-turn
        session's ids would not fit one record under the broker's size limit)."""
        chunks = [ids[i:i + MARKER_IDS] for i in range(0, len(ids), MARKER_IDS)] or [()]
        marks = [Credited(session_id=sid, request_ids=list(c), closed=closed) for c in chunks]
        return [Output(self.topics.sessions, mark.model_dump_json().encode(), sid.encode(),
                       partition=partition) for mark in marks]

    def _recover(self, partitions: list[int]) -> None:
        """Apply every Credited marker committed since the checkpoint (module doc)."""
        for p in partitions:
            tp = TopicPartition(self.topics.sessions, p)
            start = self.store.checkpoint(p)
            end = self.tail.stable_end(tp)
            marks = []
            if start < end:
                for rec in self.tail.read(tp, start, end):
                    msg = _parse(rec)
                    if isinstance(msg, Credited):
                        marks.append(Handled(p, msg.session_id, tuple(msg.request_ids), msg.closed))
            self.store.finish(marks, {p: end})
            self.pending_recovery.discard(p)
            log.info("sessions partition %d: read from %d to %d, %d credited markers applied",
                     p, start, end, len(marks))


def _parse(rec: Any) -> ForwardedEvent | TurnNote | Credited | None:
    try:
        return parse_message(rec.value)
    except (ValidationError, ValueError, TypeError):
        m.REWARD_EVENTS.labels("session_stage_invalid").inc()
        log.warning("unparseable record on %s[%d]@%d skipped", rec.topic, rec.partition, rec.offset)
        return None


def _decode(polled: Mapping[TopicPartition, Sequence[Any]]) -> tuple[dict[str, Touch], list[Handled]]:
    touched: dict[str, Touch] = {}
    markers: list[Handled] = []
    for tp, recs in polled.items():
        for rec in recs:
            msg = _parse(rec)
            if isinstance(msg, Credited):
                markers.append(Handled(tp.partition, msg.session_id, tuple(msg.request_ids), msg.closed))
            elif isinstance(msg, ForwardedEvent):
                touched.setdefault(msg.event.session_id, Touch(tp.partition)).events.append(msg)
            elif isinstance(msg, TurnNote):
                touched.setdefault(msg.session_id, Touch(tp.partition)).notes.append(msg)
    return touched, markers
