"""Session assembly: a session's events in, its ordered turns and its anomalies out.

Ingest checks every event on its own (ingest/validate.py: types, sizes, ``turn`` within
0..TURN_MAX, a summary that replaces earlier turns, a reason for invalid tool arguments) and
dead-letters what fails. What takes several events of a session to see is checked here, by
pure functions of the *set* of a session's events: the result does not depend on the order
the events arrived in, so a replay, a restart or partitions read in another order assemble
the same session. The rules (docs/events.md, "Sessions"):

- **Order.** Turns are ordered by their ``turn`` index, never by arrival or by ``ts``.
- **First claim wins.** When two events claim one thing (a turn index, a request, a call id,
  a call's result, a turn's summary, the session's end), the one with the earliest
  (``ts``, ``event_id``) keeps it; the other is set aside with the reason.
- **Placing.** A tool call, a tool result, a summary or the end belongs to the turn with its
  index, made known by that turn's ``session.turn``. It is set aside when that turn is not
  known (``unknown_turn``: assembling again once the turn has arrived places it) or is
  another request (``request_mismatch``).
- **Nothing is lost.** Every distinct event is placed (in a turn, or as the end) or set
  aside, and every set-aside event is named by an anomaly; a repeated ``event_id`` is a
  duplicate (counted). Other anomalies flag placed events and the session as a whole.
- **Closing.** A session with an end has its end's outcome. One without closes as
  ``timed_out`` (anomaly ``no_end``) once ``now`` is ``window.idle_s`` past its latest
  ``ts`` or ``window.max_s`` past its earliest; until then it is ``open``. Times are the
  producers' ``ts``, which ingest keeps within its skew and age limits.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from itertools import pairwise
from typing import Literal

from ingest.events import SessionEnd, SessionEvent, SessionSummary, SessionTurn, ToolCall, ToolResult

SET_ASIDE = {
    "other_session": "the event names another session",
    "request_in_other_session": "the turn's request is already a turn of another session",
    "turn_repeated": "the same turn of the same request again, under another event_id",
    "turn_conflict": "the turn index is already another request's",
    "request_reused": "the request is already another turn of this session",
    "unknown_turn": "no session.turn has been seen for the event's turn",
    "request_mismatch": "the event's request_id is not its turn's",
    "duplicate_call": "the call_id is already another tool call's",
    "duplicate_result": "the call already has a result",
    "duplicate_summary": "the turn already has a summary",
    "second_end": "the session already has an end",
}
"""Anomalies that set an event aside (not placed in the session), and what each means."""
FLAGGED = {
    "missing_turns": "turn indices below the highest one were never seen",
    "ts_out_of_order": "a turn's ts is earlier than the turn before it",
    "too_many_turns": "more turns than window.max_turns (all are still returned)",
    "turns_after_end": "turns after the turn the session ended on",
    "result_without_call": "a tool result answers no tool call of the session",
    "result_before_call": "a tool result is returned in a turn before its call",
    "summary_overlap": "a summary replaces turns an earlier summary already replaced",
    "call_without_result": "the session closed with a dispatched call never answered",
    "no_end": "the session timed out without a session.end",
}
"""Anomalies that flag a placed event or the session; nothing is set aside for them."""
ANOMALIES = {**SET_ASIDE, **FLAGGED}

Status = Literal["open", "completed", "abandoned", "handed_back", "timed_out"]


@dataclass(frozen=True)
class SessionWindow:
    """How long a session may stay open, and how large it may grow before it is flagged."""

    idle_s: float = 1800.0
    """A session without an end times out this long after its latest event."""
    max_s: float = 86_400.0
    """... and this long after its earliest event at the latest, however active it is."""
    max_turns: int = 10_000
    """More turns than this is flagged (``too_many_turns``); every turn is still returned."""


@dataclass(frozen=True)
class Anomaly:
    code: str
    """One of ``ANOMALIES``."""
    detail: str
    """Turn indices, counts and event ids only: never a session or request id, a tool name
    or other payload."""
    event_id: str | None = None
    """The event concerned (a set-aside event is always named); None: the whole session."""


@dataclass(frozen=True)
class Turn:
    index: int
    request_id: str
    event: SessionTurn
    tool_calls: tuple[ToolCall, ...] = ()
    """Calls the model made in this turn, in (ts, event_id) order."""
    tool_results: tuple[ToolResult, ...] = ()
    """Results returned to the model in this turn, in (ts, event_id) order."""
    summary: SessionSummary | None = None
    """Set when this turn's completion is a self-summary."""


@dataclass(frozen=True)
class Session:
    session_id: str
    turns: tuple[Turn, ...]
    """Ordered by index; indices may have gaps (``missing_turns``)."""
    end: SessionEnd | None
    status: Status
    anomalies: tuple[Anomaly, ...]
    set_aside: tuple[SessionEvent, ...]
    """Events not placed, each named by a ``SET_ASIDE`` anomaly."""
    duplicates: int = 0
    """Events whose event_id had already been given."""


def claim_order(ev: SessionEvent) -> tuple[datetime, str]:
    """Who claims first: the earliest ``ts``, then the smallest ``event_id``."""
    return ev.ts, ev.event_id


_PLACE_RANK = {"tool.call": 0, "tool.result": 1, "session.summary": 1, "session.end": 1}
"""Calls are placed before results, so a result meets its call whatever their ts."""


@dataclass
class _Builder:
    session_id: str
    turns: dict[int, Turn] = field(default_factory=dict)
    request_turn: dict[str, int] = field(default_factory=dict)
    calls: dict[str, ToolCall] = field(default_factory=dict)
    answered: set[str] = field(default_factory=set)
    end: SessionEnd | None = None
    anomalies: list[Anomaly] = field(default_factory=list)
    set_aside: list[SessionEvent] = field(default_factory=list)

    def flag(self, code: str, detail: str, ev: SessionEvent | None = None) -> None:
        self.anomalies.append(Anomaly(code, detail, None if ev is None else ev.event_id))

    def put_aside(self, ev: SessionEvent, code: str, detail: str) -> None:
        self.set_aside.append(ev)
        self.flag(code, detail, ev)

    def claim_turn(self, ev: SessionTurn) -> None:
        held = self.turns.get(ev.turn)
        if held is not None:
            code = "turn_repeated" if held.request_id == ev.request_id else "turn_conflict"
            self.put_aside(ev, code, f"turn {ev.turn} was claimed first by event {held.event.event_id}")
        elif ev.request_id in self.request_turn:
            self.put_aside(ev, "request_reused", f"turn {ev.turn}: its request is already turn "
                                                 f"{self.request_turn[ev.request_id]}")
        else:
            self.turns[ev.turn] = Turn(ev.turn, ev.request_id, ev)
            self.request_turn[ev.request_id] = ev.turn

    def place(self, ev: ToolCall | ToolResult | SessionSummary | SessionEnd) -> None:
        turn = self.turns.get(ev.turn)
        if turn is None:
            self.put_aside(ev, "unknown_turn", f"{ev.type} of turn {ev.turn}, a turn not seen")
        elif turn.request_id != ev.request_id:
            self.put_aside(ev, "request_mismatch", f"{ev.type} of turn {ev.turn} names another request")
        elif isinstance(ev, ToolCall):
            self._call(turn, ev)
        elif isinstance(ev, ToolResult):
            self._result(turn, ev)
        elif isinstance(ev, SessionSummary):
            self._summary(turn, ev)
        else:
            self._end(ev)

    def _call(self, turn: Turn, ev: ToolCall) -> None:
        first = self.calls.get(ev.call_id)
        if first is not None:
            self.put_aside(ev, "duplicate_call", f"turn {ev.turn}: the call_id is event {first.event_id}'s")
            return
        self.calls[ev.call_id] = ev
        self.turns[turn.index] = replace(turn, tool_calls=(*turn.tool_calls, ev))

    def _result(self, turn: Turn, ev: ToolResult) -> None:
        if ev.call_id in self.answered:
            self.put_aside(ev, "duplicate_result", f"turn {ev.turn}: the call already has a result")
            return
        self.answered.add(ev.call_id)
        call = self.calls.get(ev.call_id)
        if call is None:
            self.flag("result_without_call", f"turn {ev.turn}: no tool.call has its call_id", ev)
        elif ev.turn < call.turn:
            self.flag("result_before_call", f"returned in turn {ev.turn}, called in turn {call.turn}", ev)
        self.turns[turn.index] = replace(turn, tool_results=(*turn.tool_results, ev))

    def _summary(self, turn: Turn, ev: SessionSummary) -> None:
        if turn.summary is not None:
            self.put_aside(ev, "duplicate_summary", f"turn {ev.turn} already has summary event "
                                                    f"{turn.summary.event_id}")
            return
        self.turns[turn.index] = replace(turn, summary=ev)

    def _end(self, ev: SessionEnd) -> None:
        if self.end is not None:
            self.put_aside(ev, "second_end", f"the session ended first with event {self.end.event_id}")
            return
        self.end = ev


def unique_events(events: Iterable[SessionEvent]) -> tuple[list[SessionEvent], int]:
    """The events with distinct ``event_id`` in claim order, and how many repeats were dropped.
    Of two different events under one id, the one with the earlier (ts, content) is kept."""
    seen: set[str] = set()
    out: list[SessionEvent] = []
    ranked = sorted(events, key=lambda e: (*claim_order(e), e.model_dump_json()))
    for ev in ranked:
        if ev.event_id not in seen:
            seen.add(ev.event_id)
            out.append(ev)
    return out, len(ranked) - len(out)


def assemble(session_id: str, events: Iterable[SessionEvent], now: datetime,
             window: SessionWindow = SessionWindow(),
             request_owners: Mapping[str, str] | None = None) -> Session:
    """Assemble one session from its events (see the module doc for the rules).

    ``request_owners``: request id -> the session whose turn claimed it first, across
    sessions (:func:`assemble_all` builds it); this session's turn events that claim a
    request another session owns are set aside."""
    owners = request_owners or {}
    unique, duplicates = unique_events(events)
    b = _Builder(session_id)
    mine: list[SessionEvent] = []
    for ev in unique:
        if ev.session_id != session_id:
            b.put_aside(ev, "other_session", f"{ev.type} of turn {ev.turn} names another session")
        elif isinstance(ev, SessionTurn) and owners.get(ev.request_id, session_id) != session_id:
            b.put_aside(ev, "request_in_other_session", f"turn {ev.turn}: the request is a turn "
                                                        "of another session")
        else:
            mine.append(ev)
    for ev in mine:
        if isinstance(ev, SessionTurn):
            b.claim_turn(ev)
    for ev in sorted((e for e in mine if not isinstance(e, SessionTurn)),
                     key=lambda e: (_PLACE_RANK[e.type], *claim_order(e))):
        b.place(ev)
    turns = tuple(b.turns[i] for i in sorted(b.turns))
    _check_turns(b, turns, window)
    status = _status(b, mine, now, window)
    if status != "open":
        _unanswered(b, turns)
    return Session(session_id, turns, b.end, status, tuple(b.anomalies), tuple(b.set_aside), duplicates)


def assemble_all(events: Iterable[SessionEvent], now: datetime,
                 window: SessionWindow = SessionWindow()) -> dict[str, Session]:
    """Assemble every session of ``events``, by session id. A request claimed as a turn by
    several sessions stays with the earliest claim (``request_in_other_session`` elsewhere)."""
    given = list(events)
    owners: dict[str, str] = {}
    for ev in unique_events(given)[0]:
        if isinstance(ev, SessionTurn):
            owners.setdefault(ev.request_id, ev.session_id)
    by_session: dict[str, list[SessionEvent]] = defaultdict(list)
    for ev in given:
        by_session[ev.session_id].append(ev)
    return {sid: assemble(sid, evs, now, window, owners) for sid, evs in sorted(by_session.items())}


def _check_turns(b: _Builder, turns: tuple[Turn, ...], window: SessionWindow) -> None:
    """The flags on the turns as a whole: gaps, ts order, size, turns after the end, and
    summaries that replace turns already replaced."""
    if turns:
        gaps = _gaps([t.index for t in turns])
        if gaps:
            b.flag("missing_turns", _describe_gaps(gaps))
    for before, after in pairwise(turns):
        if after.event.ts < before.event.ts:
            b.flag("ts_out_of_order", f"turn {after.index} has an earlier ts than turn {before.index}",
                   after.event)
    if len(turns) > window.max_turns:
        b.flag("too_many_turns", f"{len(turns)} turns > {window.max_turns}")
    if b.end is not None:
        later = sum(1 for t in turns if t.index > b.end.turn)
        if later:
            b.flag("turns_after_end", f"{later} turns after turn {b.end.turn}, the last one by the end",
                   b.end)
    _overlapping_summaries(b, [t.summary for t in turns if t.summary is not None])


def _gaps(indices: list[int]) -> list[tuple[int, int]]:
    """The missing ranges (inclusive) of sorted, distinct turn indices counted from 0."""
    gaps: list[tuple[int, int]] = []
    expected = 0
    for i in indices:
        if i > expected:
            gaps.append((expected, i - 1))
        expected = i + 1
    return gaps


def _describe_gaps(gaps: list[tuple[int, int]]) -> str:
    total = sum(b - a + 1 for a, b in gaps)
    if total == 1:
        return f"turn {gaps[0][0]} missing"
    shown = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in gaps[:3])
    more = f" and {len(gaps) - 3} more ranges" if len(gaps) > 3 else ""
    return f"turns {shown}{more} missing ({total} in all)"


def _overlapping_summaries(b: _Builder, summaries: list[SessionSummary]) -> None:
    """Flag a summary whose range meets an earlier-starting one; of the two, the later turn's."""
    reach: SessionSummary | None = None  # of the ranges so far, the one reaching furthest
    flagged: set[str] = set()
    for s in sorted(summaries, key=lambda s: (s.replaced_from, s.turn)):
        if reach is not None and s.replaced_from <= reach.replaced_to:
            later = s if s.turn > reach.turn else reach
            if later.event_id not in flagged:
                flagged.add(later.event_id)
                b.flag("summary_overlap", f"turn {later.turn} replaces turns the summary of turn "
                                          f"{(reach if later is s else s).turn} replaced", later)
        if reach is None or s.replaced_to > reach.replaced_to:
            reach = s


def _status(b: _Builder, events: list[SessionEvent], now: datetime, window: SessionWindow) -> Status:
    if b.end is not None:
        return b.end.outcome
    if not events:
        return "open"
    idle = (now - max(e.ts for e in events)).total_seconds()
    age = (now - min(e.ts for e in events)).total_seconds()
    if idle < window.idle_s and age < window.max_s:
        return "open"
    why = f"idle {idle:.0f}s (limit {window.idle_s:.0f}s)" if idle >= window.idle_s \
        else f"open {age:.0f}s (limit {window.max_s:.0f}s)"
    b.flag("no_end", f"no session.end; {why}")
    return "timed_out"


def _unanswered(b: _Builder, turns: tuple[Turn, ...]) -> None:
    for t in turns:
        for call in t.tool_calls:
            if call.outcome == "dispatched" and call.call_id not in b.answered:
                b.flag("call_without_result", f"a call of turn {t.index} got no tool.result", call)
