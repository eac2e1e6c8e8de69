"""The reward worker's session stage as pure functions (ingest/reward/session_stage.py): when a
session closes on the stage's clock, how long it waits for its turns and their notes, which
records it emits, and the stage-1 window's claims."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from ingest.events import CompletionServed, ModelRef, SessionEnd, SessionEvent, SessionTurn, ToolCall
from ingest.reward.join import MAX_CLAIMS, Window, apply, close
from ingest.reward.session_credit import COMPONENTS
from ingest.reward.session_stage import (
    Credited,
    ForwardedEvent,
    NoteFacts,
    SessionState,
    TurnNote,
    decide,
    late_note_records,
    may_close_at,
    note_wait_s,
    parse_message,
)
from ingest.reward.spec import load_spec

ROOT = Path(__file__).resolve().parents[2]
SPEC = load_spec(ROOT / "ingest" / "reward" / "specs" / "agent.toml")
DEFAULT = load_spec()
T0 = datetime(2026, 11, 22, 10, 0, tzinfo=UTC)
SCALE = 1.0
SID = "s1"


def turn(t: int, rid: str | None = None, sid: str = SID) -> SessionTurn:
    return SessionTurn(event_id=f"{sid}-t{t}-{rid}", request_id=rid or f"r{t}", ts=T0 + timedelta(seconds=t),
                       session_id=sid, turn=t)


def end(t: int, outcome: str = "completed") -> SessionEnd:
    return SessionEnd(event_id=f"end-{t}", request_id=f"r{t}", ts=T0 + timedelta(seconds=t + 1),
                      session_id=SID, turn=t, outcome=outcome)  # type: ignore[arg-type]


def bad_call(t: int) -> ToolCall:
    return ToolCall(event_id=f"c{t}", request_id=f"r{t}", ts=T0 + timedelta(seconds=t), session_id=SID,
                    turn=t, call_id=f"c{t}", tool="run", arguments_valid=False, invalid_reason="not_json",
                    outcome="blocked")


def served(rid: str, prompt: int = 100, completion: int = 10, kind: str = "tool_call") -> CompletionServed:
    return CompletionServed(event_id=f"{rid}-s", request_id=rid, ts=T0, session_id=SID, user_key="u",
                            model=ModelRef(name="m", version="1"), arm="stable", prompt_tokens=[3] * prompt,
                            completion_tokens=[4] * completion, logprobs=[-0.5] * completion,
                            latency_ms=100.0, completion_kind=kind)  # type: ignore[arg-type]


def note(rid: str, prompt: int = 100, completion: int = 10, with_record: bool = True) -> TurnNote:
    w = apply(None, served(rid, prompt, completion), 0.0, SPEC)
    rec = close(w, SPEC, 1.0).record
    facts = NoteFacts(prompt_tokens=prompt, completion_tokens=completion) if with_record else None
    return TurnNote(session_id=SID, request_id=rid, partition=2, record=rec if with_record else None,
                    facts=facts)


def state(events: list[SessionEvent], notes: list[TurnNote], first: float = 0.0, last: float | None = 0.0,
          end_seen: float | None = None) -> SessionState:
    return SessionState(SID, {e.event_id: e for e in events}, {n.request_id: n for n in notes}, first, last,
                        end_seen)


# ------------------------------------------------------------------ when a session may close
def test_may_close_at_end_else_idle_or_max_on_the_stage_clock() -> None:
    s = SPEC.session
    assert s is not None
    assert may_close_at(None, None, None, SPEC, SCALE) is None
    assert may_close_at(10.0, 50.0, 70.0, SPEC, SCALE) == 70.0  # an end: at once
    assert may_close_at(10.0, 50.0, None, SPEC, 0.5) == 50.0 + s.idle_s * 0.5
    assert may_close_at(10.0, 10.0 + s.max_s, None, SPEC, 1.0) == 10.0 + s.max_s  # max_s caps idle
    assert may_close_at(10.0, None, None, SPEC, 1.0) == 10.0 + s.idle_s  # notes only: from the first


def test_an_open_session_waits_and_says_when() -> None:
    st = state([turn(0)], [note("r0")], first=0.0, last=5.0)
    d = decide(st, 100.0, SPEC, SCALE)
    assert d.records is None and d.next_at == 5.0 + 1800.0


def test_a_session_without_an_end_times_out_and_credits_its_turns() -> None:
    st = state([turn(0), turn(1)], [note("r0"), note("r1", prompt=400)], first=0.0, last=5.0)
    d = decide(st, 5.0 + 1800.0, SPEC, SCALE)
    assert d.records is not None and d.session is not None and d.session.status == "timed_out"
    recs = {r.request_id: r for r in d.records}
    assert set(recs) == {"r0", "r1"}
    for r in recs.values():
        assert set(r.components) == set(COMPONENTS) and r.components["outcome"] == 0.0
        assert r.reward == pytest.approx(sum(r.components.values()))
        assert r.components["tokens"] == pytest.approx(-0.002 * (110 + 410) / 1000)
    assert d.handled == ("r0", "r1")


def test_an_ended_session_credits_at_once_with_its_own_invalid_calls() -> None:
    st = state([turn(0), turn(1), bad_call(1), end(1)], [note("r0"), note("r1")], end_seen=3.0)
    d = decide(st, 3.0, SPEC, SCALE)
    assert d.records is not None
    recs = {r.request_id: r for r in d.records}
    assert recs["r0"].components["invalid_tool_calls"] == 0.0
    assert recs["r1"].components["invalid_tool_calls"] == -0.25
    assert recs["r0"].reward - recs["r1"].reward == pytest.approx(0.25)
    assert recs["r0"].components["outcome"] == 1.0 and not recs["r0"].defaulted


def test_it_waits_for_notes_and_for_turns_below_the_end_then_gives_up() -> None:
    wait = note_wait_s(SPEC, SCALE)
    no_note = state([turn(0), turn(1), end(1)], [note("r0")], end_seen=3.0)
    assert decide(no_note, 3.0, SPEC, SCALE).next_at == 3.0 + wait
    gap = state([turn(0), turn(2), end(2)], [note("r0"), note("r2")], end_seen=3.0)  # turn 1 unseen
    assert decide(gap, 3.0 + wait - 1, SPEC, SCALE).records is None
    late = decide(no_note, 3.0 + wait, SPEC, SCALE)  # the note never came: r1 not credited
    assert late.records is not None and [r.request_id for r in late.records] == ["r0"]
    assert late.missing == ("r1",) and late.records[0].components["turns"] == -0.02
    done = decide(gap, 3.0 + wait, SPEC, SCALE)
    assert done.records is not None and {r.request_id for r in done.records} == {"r0", "r2"}


def test_an_end_the_assembly_sets_aside_does_not_close_the_session() -> None:
    st = state([turn(0), end(3)], [note("r0")], first=0.0, last=2.0, end_seen=2.0)  # turn 3 unknown
    d = decide(st, 2.0, SPEC, SCALE)
    assert d.records is None and d.next_at == 2.0 + 1800.0


def test_set_aside_and_unserved_turns_keep_their_per_request_record_or_none() -> None:
    conflict = turn(0, rid="rx")  # turn 0 claimed by r0 first (earlier event_id order at equal ts)
    st = state([turn(0), conflict, end(0)], [note("r0"), note("rx"), note("r9", with_record=False)],
               end_seen=1.0)
    d = decide(st, 1.0, SPEC, SCALE)
    assert d.records is not None
    recs = {r.request_id: r for r in d.records}
    assert set(recs) == {"r0", "rx"}
    assert "outcome" in recs["r0"].components
    assert recs["rx"] == note("rx").record  # unchanged
    assert set(d.handled) == {"r0", "rx", "r9"}


def test_the_stage_needs_a_session_table() -> None:
    with pytest.raises(ValueError, match="session"):
        decide(state([], []), 0.0, DEFAULT, SCALE)


def test_late_notes_give_each_request_its_record_once() -> None:
    notes = [note("r5"), note("r5"), note("r6", with_record=False), note("r7")]
    recs, ids = late_note_records(notes, handled={"r7"})
    assert [r.request_id for r in recs] == ["r5"] and ids == ["r5", "r6"]


# ------------------------------------------------------------------ messages
def test_messages_round_trip_and_reject_unknown_kinds() -> None:
    for msg in (ForwardedEvent(event=end(1)), note("r0"), Credited(session_id=SID, request_ids=["r0"])):
        assert parse_message(msg.model_dump_json()) == msg
    with pytest.raises(ValueError):
        parse_message(json.dumps({"kind": "other", "session_id": SID}))
    with pytest.raises(ValueError):
        parse_message(json.dumps({"kind": "credited", "session_id": "bad id", "request_ids": []}))


# ------------------------------------------------------------------ the per-request window's claims
def _claims(events: list[Any]) -> Window:
    w = None
    for ev in events:
        w = apply(w, ev, 0.0, SPEC)
    assert w is not None
    return w


def test_a_window_remembers_the_sessions_that_claimed_it_in_order_and_bounded() -> None:
    evs = [SessionTurn(event_id=f"e{i}", request_id="r0", ts=T0, session_id=f"s{i % (MAX_CLAIMS + 3)}",
                       turn=0) for i in range(3 * MAX_CLAIMS)]
    w = _claims([served("r0"), *evs])
    assert w.sessions == tuple(f"s{i}" for i in range(MAX_CLAIMS))
    assert Window.from_json(w.to_json()) == w
    legacy = json.loads(w.to_json())
    del legacy["sessions"]  # a window stored before sessions existed
    assert Window.from_json(json.dumps(legacy)).sessions == ()


def test_a_session_with_notes_only_gives_each_request_its_own_record() -> None:
    st = state([], [note("r1"), note("r2", with_record=False)], first=0.0, last=None)
    assert decide(st, 10.0, SPEC, SCALE).records is None  # not yet: idle from the first note
    d = decide(st, 1800.0, SPEC, SCALE)
    assert d.records == (note("r1").record,) and d.handled == ("r1", "r2")


# ------------------------------------------------------------------ the worker's halves
def test_markers_hold_at_most_a_thousand_ids_and_an_empty_session_gets_one() -> None:
    from services.settings.model import Settings
    from services.wiring.reward_sessions import MARKER_IDS, SessionStage

    stage = SessionStage(Settings(), SPEC, store=None, tail=None)  # type: ignore[arg-type]
    ids = [f"req-{i:0120d}" for i in range(2 * MARKER_IDS + 1)]
    outs = stage._markers(3, SID, ids, closed=True)
    marks = [parse_message(o.value) for o in outs]
    assert [len(m.request_ids) for m in marks] == [MARKER_IDS, MARKER_IDS, 1]  # type: ignore[union-attr]
    assert all(o.partition == 3 and o.key == SID.encode() and len(o.value) < 200_000 for o in outs)
    assert len(stage._markers(0, SID, [], closed=True)) == 1


def test_the_join_moves_its_rewards_checkpoint_by_rewards_records_only() -> None:
    from types import SimpleNamespace

    from services.runtime.exactly_once import Batch
    from services.settings.model import Settings
    from services.wiring.reward import JoinResult, RewardJoin

    calls: list[Any] = []
    store = SimpleNamespace(finish=lambda *a: calls.append(a))
    s = Settings()
    join = RewardJoin(s, SPEC, store, tail=None)  # type: ignore[arg-type]
    delivered = [SimpleNamespace(topic=s.topics.sessions, partition=1, offset=900),
                 SimpleNamespace(topic=s.topics.rewards, partition=1, offset=7)]
    join.committed(Batch([], JoinResult()), delivered)
    assert calls[0][3] == {1: 8}


def test_notes_bring_a_look_forward_at_most_once_a_second_and_never_push_it_back() -> None:
    from ingest.adapters.redis_sessions import NOTE_RECHECK_S, next_look

    now = 100.0
    assert next_look(150.0, 120.0, True, now) == 150.0  # events: when the session may close
    assert next_look(None, None, False, now) is None
    assert next_look(50.0, 900.0, False, now) == now + NOTE_RECHECK_S  # waiting closed session: soon
    assert next_look(50.0, now + 0.5, False, now) is None  # already looked at sooner
    assert next_look(150.0, 150.0, False, now) is None  # open: its timer stays
    assert next_look(50.0, None, False, now) == now + NOTE_RECHECK_S  # no timer: one is set


def test_a_turn_logged_before_its_served_event_has_claimed_the_window_before_it_can_close() -> None:
    """The gateway sends a turn's session.turn before its completion.served (one partition, in
    order): the window is claimed before the served event starts its early-close clock, so
    no batch boundary or restarted worker can close it into a per-request reward first."""
    from ingest.reward.join import close_at, due_at

    w = apply(None, turn(0, "r0"), 0.0, SPEC)
    assert w.sessions == (SID,) and w.served is None
    assert close_at(w, SPEC) == due_at(w, SPEC)  # nothing closes early before the served event
    w = apply(w, served("r0", kind="question"), 5.0, SPEC)
    assert w.sessions == (SID,) and close_at(w, SPEC) == 5.0 + SPEC.window.followup_s
    assert close(w, SPEC, 70.0).record is not None
