"""The reward worker's session stage, as pure functions (docs/rewards.md, "Sessions: how the
worker joins them").

A session's turns are requests on several events partitions, so the per-request stage
re-keys what a session needs by ``session_id`` onto an internal topic (``topics.sessions``),
in the transaction that commits the events it consumed. Three kinds of message go there:

- :class:`ForwardedEvent`: every session event, as it was consumed;
- :class:`TurnNote`: a request a ``session.turn`` claimed, once its per-request window has
  closed: its reward record and :class:`~ingest.reward.session_credit.TurnFacts` when it
  was served, neither when it was not (or when its per-request record was already out);
- :class:`Credited`: written by this stage with a session's records: the request ids it has
  handled, so a restarted stage knows them (it reads them back, as the per-request stage
  reads its rewards partitions back).

Every message of a session lands on one partition, so one worker holds the whole session.
:func:`decide` turns a session's state into its records once it may close:

- **When**: at once after a ``session.end`` has been seen; without one, ``idle_s * scale``
  after the latest session event was seen or ``max_s * scale`` after the first message,
  whichever comes first (the stage's processing clock, as the per-request windows use; the
  producers' ``ts`` only orders claims inside the assembly).
- **Waiting for notes and turns**: every placed turn's note is on its way (its window closes
  at most ``window_s * scale`` after the turn's first event, and that was before the session
  could close), and the ``session.turn`` of an index below the last (the end's turn) may still
  be in flight on another partition. A session waits for both at most
  ``window_s * scale + NOTE_SLACK_S`` after it could close; a turn whose note never came is then
  neither credited nor counted, and a turn seen only later gets its per-request record.
- **Records**: one per served turn with the session credit (``ingest/reward/session_credit``);
  every other note with a record (a request whose ``session.turn`` the assembly set aside)
  gets its per-request record unchanged. Each request handled appears in the session's
  :class:`Credited` marker, so a note repeated by a restarted per-request stage is a duplicate.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from ingest.events import CreditedSession, Id, RewardRecord, SessionEnd, SessionEvent
from ingest.reward.join import Window
from ingest.reward.session_credit import TurnFacts, credit, edit_persisted, invalid_calls, served_turns
from ingest.reward.sessions import Session, assemble
from ingest.reward.spec import RewardSpec

NOTE_SLACK_S = 60.0
"""Slack for processing lag on top of the longest a turn's note can take."""


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NoteFacts(_Msg):
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    dissatisfied: int = Field(default=0, ge=0)
    edit_persisted: float | None = None

    def facts(self) -> TurnFacts:
        return TurnFacts(self.prompt_tokens, self.completion_tokens, self.dissatisfied, self.edit_persisted)


def note_facts(w: Window, spec: RewardSpec) -> NoteFacts | None:
    """What a closed request window tells its session (None: it was never served)."""
    s = w.served
    if s is None:
        return None
    fb = w.feedback()
    return NoteFacts(prompt_tokens=len(s.prompt_tokens), completion_tokens=len(s.completion_tokens),
                     dissatisfied=fb.dissatisfied,
                     edit_persisted=edit_persisted(fb, s.completion_kind, spec.persistence.primary_horizon_s))


class ForwardedEvent(_Msg):
    kind: Literal["event"] = "event"
    event: Annotated[SessionEvent, Field(discriminator="type")]


class TurnNote(_Msg):
    kind: Literal["turn"] = "turn"
    session_id: Id
    request_id: Id
    partition: int = Field(ge=0)
    """The request's events partition: its reward record goes to the same rewards partition."""
    record: RewardRecord | None = None
    """The per-request record of a served request this session may credit; None: nothing to
    credit (never served, claimed first by another session, or its record already out)."""
    facts: NoteFacts | None = None


class Credited(_Msg):
    kind: Literal["credited"] = "credited"
    session_id: Id
    request_ids: list[Id]
    """Requests handled (credited, or given their per-request record)."""
    closed: bool = True
    """False: only late notes of a session credited earlier."""


StageMessage = Annotated[ForwardedEvent | TurnNote | Credited, Field(discriminator="kind")]
STAGE_ADAPTER: TypeAdapter[ForwardedEvent | TurnNote | Credited] = TypeAdapter(StageMessage)


def parse_message(data: bytes | str) -> ForwardedEvent | TurnNote | Credited:
    return STAGE_ADAPTER.validate_json(data)


@dataclass(frozen=True)
class SessionState:
    """What the stage holds of one open session."""

    session_id: str
    events: Mapping[str, SessionEvent] = field(default_factory=dict)
    """By event_id, the first one seen."""
    notes: Mapping[str, TurnNote] = field(default_factory=dict)
    """By request id, the first one seen."""
    first_seen: float | None = None
    """Processing time the first message of the session was seen."""
    last_event_seen: float | None = None
    """Processing time the latest session event was seen."""
    end_seen: float | None = None
    """Processing time a ``session.end`` was first seen."""


def may_close_at(first_seen: float | None, last_event_seen: float | None, end_seen: float | None,
                 spec: RewardSpec, scale: float) -> float | None:
    """When the session may close by its window (module doc); None: nothing seen yet."""
    if spec.session is None or first_seen is None:
        return None
    if end_seen is not None:
        return end_seen
    last = first_seen if last_event_seen is None else last_event_seen
    return min(last + spec.session.idle_s * scale, first_seen + spec.session.max_s * scale)


def note_wait_s(spec: RewardSpec, scale: float) -> float:
    """The longest a closed session waits for its turns' notes."""
    return spec.window_s * scale + NOTE_SLACK_S


@dataclass(frozen=True)
class Decision:
    records: tuple[RewardRecord, ...] | None
    """None: the session stays open (see ``next_at``); else every record it emits now."""
    handled: tuple[str, ...] = ()
    """Request ids of every note the session has (they go in its Credited marker)."""
    next_at: float | None = None
    """Open: when to look again."""
    session: Session | None = None
    missing: tuple[str, ...] = ()
    """Placed turns credited without their note (it never came)."""


def assemble_closed(state: SessionState, spec: RewardSpec, timed_out: bool) -> Session:
    """The session assembled as closed: by its end, or ``timed_out`` when ``timed_out``."""
    assert spec.session is not None
    events = list(state.events.values())
    window = spec.session.window
    if not events:
        return assemble(state.session_id, [], datetime.now(UTC), window)
    if timed_out:  # the stage's clock said so; make the assembly's producer clock agree
        at = max(e.ts for e in events) + timedelta(seconds=window.idle_s)
    else:
        at = min(e.ts for e in events)
    return assemble(state.session_id, events, at, window)


def decide(state: SessionState, now: float, spec: RewardSpec, scale: float) -> Decision:
    """The session's records if it may close at ``now`` (module doc), else when to look again."""
    if spec.session is None:
        raise ValueError("the spec has no [session] table")
    closes = may_close_at(state.first_seen, state.last_event_seen, state.end_seen, spec, scale)
    if closes is None or now < closes:
        return Decision(None, next_at=closes)
    if not state.events:  # notes only (their session's events expired or were never kept)
        records = tuple(n.record for _, n in sorted(state.notes.items()) if n.record is not None)
        return Decision(records, tuple(sorted(state.notes)))
    has_end = any(isinstance(e, SessionEnd) for e in state.events.values())
    session = assemble_closed(state, spec, timed_out=not has_end)
    if session.status == "open":  # its end was set aside (e.g. a turn not seen): wait for the window
        closes = may_close_at(state.first_seen, state.last_event_seen, None, spec, scale)
        assert closes is not None
        if now < closes:
            return Decision(None, next_at=closes)
        session = assemble_closed(state, spec, timed_out=True)
    missing = tuple(t.request_id for t in session.turns if t.request_id not in state.notes)
    deadline = closes + note_wait_s(spec, scale)
    if (missing or unseen_turns(session)) and now < deadline:
        return Decision(None, next_at=deadline)
    return _records(state, session, spec, now, missing)


def credited_sessions(session: Session, facts: Mapping[str, TurnFacts]) -> list[CreditedSession]:
    """What each credited turn's record says of its session, in the order of
    ``session_credit.credit`` (the served turns, by index)."""
    turns = served_turns(session, facts)
    assert session.status != "open", "an open session is not credited"
    invalid = sum(invalid_calls(t) for t in turns)
    return [CreditedSession(turn=t.index, turns=len(turns), status=session.status,
                            invalid_tool_calls=invalid, lead=i == 0) for i, t in enumerate(turns)]


def unseen_turns(session: Session) -> int:
    """Turns the session must have had but whose ``session.turn`` has not been seen: indices
    below its last (its end's turn, else its highest)."""
    last = session.end.turn if session.end is not None else max((t.index for t in session.turns), default=-1)
    return last + 1 - sum(1 for t in session.turns if t.index <= last)


def _records(state: SessionState, session: Session, spec: RewardSpec, now: float,
             missing: tuple[str, ...]) -> Decision:
    assert spec.session is not None
    served = {rid: n for rid, n in state.notes.items() if n.record is not None and n.facts is not None}
    facts = {rid: n.facts.facts() for rid, n in served.items() if n.facts is not None}
    credits = credit(session, facts, spec.session)
    closed_ts = datetime.fromtimestamp(now, UTC)
    out: list[RewardRecord] = []
    for c, about in zip(credits, credited_sessions(session, facts), strict=True):
        rec = served[c.request_id].record
        assert rec is not None
        out.append(rec.model_copy(update={"reward": c.reward, "components": dict(c.components),
                                          "closed_ts": closed_ts, "defaulted": False,
                                          "session_credit": about}))
    credited = {c.request_id for c in credits}
    out += [n.record for rid, n in sorted(state.notes.items())
            if n.record is not None and rid not in credited]
    return Decision(tuple(out), tuple(sorted(state.notes)), session=session, missing=missing)


def late_note_records(notes: list[TurnNote], handled: set[str]) -> tuple[list[RewardRecord], list[str]]:
    """Notes for a session already credited: each request not yet handled gets its
    per-request record (if it has one) once; returns the records and the newly handled ids."""
    out, ids = [], []
    for n in notes:
        if n.request_id in handled or n.request_id in ids:
            continue
        ids.append(n.request_id)
        if n.record is not None:
            out.append(n.record)
    return out, ids
