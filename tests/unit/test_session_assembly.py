"""Session assembly (ingest/reward/sessions.py) on hand-built sessions: ordering, placing,
first-claim-wins, closing, and the hostile cases (turns out of order, a turn of another
session, a session that never ends, 10,000 turns, conflicting claims), each with the
anomalies it must give and nothing lost."""

from __future__ import annotations

import random
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from ingest.events import SessionEnd, SessionEvent, SessionSummary, SessionTurn, ToolCall, ToolResult
from ingest.reward.sessions import (
    ANOMALIES,
    FLAGGED,
    SET_ASIDE,
    Session,
    SessionWindow,
    assemble,
    assemble_all,
)

T0 = datetime(2026, 11, 22, 10, 0, tzinfo=UTC)
SID = "s1"


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def common(eid: str, turn: int, t: float, sid: str, req: str | None) -> dict[str, Any]:
    return {"event_id": eid, "session_id": sid, "turn": turn, "ts": at(t),
            "request_id": req if req is not None else f"r{turn}"}


def turn(eid: str, n: int, t: float | None = None, sid: str = SID, req: str | None = None) -> SessionTurn:
    return SessionTurn(**common(eid, n, 60.0 * n if t is None else t, sid, req))


def call(eid: str, n: int, cid: str, t: float | None = None, valid: bool = True,
         outcome: str = "dispatched", req: str | None = None) -> ToolCall:
    return ToolCall(**common(eid, n, 60.0 * n + 1 if t is None else t, SID, req), call_id=cid, tool="search",
                    arguments_valid=valid, invalid_reason=None if valid else "schema_mismatch",
                    outcome=outcome)


def result(eid: str, n: int, cid: str, t: float | None = None, req: str | None = None) -> ToolResult:
    return ToolResult(**common(eid, n, 60.0 * n + 2 if t is None else t, SID, req), call_id=cid,
                      status="ok", result_tokens=40)


def summary(eid: str, n: int, lo: int, hi: int, t: float | None = None) -> SessionSummary:
    return SessionSummary(**common(eid, n, 60.0 * n + 3 if t is None else t, SID, None),
                          replaced_from=lo, replaced_to=hi, summary_tokens=120)


def end(eid: str, n: int, outcome: str = "completed", t: float | None = None) -> SessionEnd:
    return SessionEnd(**common(eid, n, 60.0 * n + 5 if t is None else t, SID, None), outcome=outcome)


def codes(s: Session) -> list[tuple[str, str | None]]:
    return [(a.code, a.event_id) for a in s.anomalies]


def placed_ids(s: Session) -> list[str]:
    out = [e.event_id for t in s.turns for e in (t.event, *t.tool_calls, *t.tool_results) if e is not None]
    out += [t.summary.event_id for t in s.turns if t.summary is not None]
    return out + ([s.end.event_id] if s.end is not None else [])


def assert_nothing_lost(s: Session, given: list[SessionEvent]) -> None:
    """Every distinct event is placed or set aside, once; every set-aside one is named."""
    placed, aside = placed_ids(s), [e.event_id for e in s.set_aside]
    assert sorted(placed + aside) == sorted({e.event_id for e in given})
    named = {a.event_id for a in s.anomalies if a.code in SET_ASIDE}
    assert set(aside) == named


GOOD = [turn("t0", 0), call("c0", 0, "k1"), turn("t1", 1), result("x0", 1, "k1"),
        call("c1", 1, "k2", valid=False, outcome="blocked"), turn("t2", 2), summary("m2", 2, 0, 1),
        turn("t3", 3), end("end", 3)]


def test_a_complete_session_is_ordered_and_placed() -> None:
    s = assemble(SID, GOOD, now=at(300))
    assert [(t.index, t.request_id) for t in s.turns] == [(0, "r0"), (1, "r1"), (2, "r2"), (3, "r3")]
    assert [c.call_id for c in s.turns[0].tool_calls] == ["k1"]
    assert [(r.call_id, r.turn) for r in s.turns[1].tool_results] == [("k1", 1)]
    assert s.turns[1].tool_calls[0].outcome == "blocked"  # blocked: no result expected
    assert s.turns[2].summary is not None and s.turns[2].summary.replaced_to == 1
    assert s.end is not None and s.status == "completed"
    assert s.anomalies == () and s.set_aside == () and s.duplicates == 0


@pytest.mark.parametrize("seed", range(20))
def test_arrival_order_changes_nothing(seed: int) -> None:
    hostile = [*GOOD, turn("t3b", 3, req="r9"), call("c9", 7, "k9"), result("x9", 2, "nope"),
               end("end2", 2, "abandoned", t=10), call("c0b", 0, "k1", t=0.5), turn("t2dup", 2, t=125)]
    shuffled = hostile[:]
    random.Random(seed).shuffle(shuffled)
    assert assemble(SID, shuffled, at(300)) == assemble(SID, hostile, at(300))


def test_turns_out_of_order_are_ordered_by_index_and_a_ts_against_the_index_is_flagged() -> None:
    evs = [turn("t3", 3, t=100), turn("t1", 1, t=50), turn("t0", 0, t=0), turn("t2", 2, t=40)]
    s = assemble(SID, evs, at(200))
    assert [t.index for t in s.turns] == [0, 1, 2, 3]
    assert codes(s) == [("ts_out_of_order", "t2")]
    assert s.anomalies[0].detail == "turn 2 has an earlier ts than turn 1"


def test_an_event_of_another_session_is_set_aside() -> None:
    evs = [turn("t0", 0), turn("alien", 1, sid="s2"), end("end", 0)]
    s = assemble(SID, evs, at(100))
    assert [t.index for t in s.turns] == [0]
    assert codes(s) == [("other_session", "alien")]
    assert_nothing_lost(s, evs)


def test_a_turn_claiming_another_sessions_request_stays_with_the_first_claim() -> None:
    evs = [turn("a0", 0, t=0, sid="sa", req="shared"), turn("b0", 0, t=5, sid="sb", req="shared"),
           turn("b1", 1, t=10, sid="sb", req="rb1")]
    out = assemble_all(evs, at(20))
    assert [t.request_id for t in out["sa"].turns] == ["shared"] and out["sa"].anomalies == ()
    b = out["sb"]
    assert [t.request_id for t in b.turns] == ["rb1"]
    assert codes(b) == [("request_in_other_session", "b0"), ("missing_turns", None)]
    assert [e.event_id for e in b.set_aside] == ["b0"]


def test_conflicting_turn_claims_first_claim_wins() -> None:
    evs = [turn("t0", 0), turn("late", 0, t=5, req="rX"), turn("same", 0, t=9),
           turn("t1", 1, req="r0")]
    s = assemble(SID, evs, at(100))
    assert [(t.index, t.request_id, t.event.event_id) for t in s.turns] == [(0, "r0", "t0")]
    assert codes(s) == [("turn_conflict", "late"), ("turn_repeated", "same"), ("request_reused", "t1")]
    assert s.anomalies[2].detail == "turn 1: its request is already turn 0"
    assert_nothing_lost(s, evs)


def test_ts_ties_are_broken_by_event_id() -> None:
    s = assemble(SID, [turn("b", 0, t=0, req="rB"), turn("a", 0, t=0, req="rA")], at(10))
    assert s.turns[0].request_id == "rA" and codes(s) == [("turn_conflict", "b")]


def test_a_session_that_never_ends_times_out_after_idle_and_after_max_age() -> None:
    evs = [turn("t0", 0, t=0), call("c0", 0, "k1", t=1), turn("t1", 1, t=60)]
    w = SessionWindow(idle_s=600, max_s=3600)
    assert assemble(SID, evs, at(659), w).status == "open"
    s = assemble(SID, evs, at(660), w)
    assert s.status == "timed_out"
    assert codes(s) == [("no_end", None), ("call_without_result", "c0")]
    assert s.anomalies[0].detail == "no session.end; idle 600s (limit 600s)"
    busy = [turn(f"t{i}", i, t=50.0 * i) for i in range(80)]  # one turn every 50 s, never idle
    assert assemble(SID, busy, at(3550), w).status == "open"
    late = assemble(SID, busy, at(3600), w)
    assert late.status == "timed_out"
    assert late.anomalies[0].detail == "no session.end; open 3600s (limit 3600s)"


def test_an_open_session_does_not_yet_miss_results() -> None:
    s = assemble(SID, [turn("t0", 0), call("c0", 0, "k1")], at(10))
    assert s.status == "open" and s.anomalies == ()


@pytest.mark.parametrize("outcome", ["completed", "abandoned", "handed_back"])
def test_the_end_gives_the_status(outcome: str) -> None:
    assert assemble(SID, [turn("t0", 0), end("e", 0, outcome)], at(10)).status == outcome


def test_ten_thousand_turns_assemble_quickly_and_one_more_is_flagged_not_dropped() -> None:
    evs: list[SessionEvent] = [turn(f"t{i}", i, t=i) for i in range(10_001)]
    evs += [call(f"c{i}", i, f"k{i}", t=i + 0.5) for i in range(0, 10_001, 2)]
    evs += [result(f"x{i}", i + 1, f"k{i}", t=i + 1.5) for i in range(0, 10_000, 2)]
    evs.append(end("end", 10_000, t=20_000))
    started = time.perf_counter()
    s = assemble(SID, evs, at(20_001))
    assert time.perf_counter() - started < 5
    assert len(s.turns) == 10_001 and [t.index for t in s.turns] == list(range(10_001))
    assert codes(s) == [("too_many_turns", None), ("call_without_result", "c10000")]
    assert s.anomalies[0].detail == "10001 turns > 10000"
    assert_nothing_lost(s, evs)
    assert assemble(SID, evs[:10_000], at(20_001), SessionWindow(max_turns=10_000)).status == "timed_out"


def test_gaps_are_one_anomaly_with_ranges_even_for_an_absurd_index() -> None:
    s = assemble(SID, [turn(f"t{i}", i) for i in (0, 1, 5, 9, 12, 20)], at(2000))
    assert codes(s) == [("missing_turns", None)]
    assert s.anomalies[0].detail == "turns 2-4, 6-8, 10-11 and 1 more ranges missing (15 in all)"
    far = assemble(SID, [turn("t0", 0), turn("far", 999_999, t=1)], at(2))
    assert [a.detail for a in far.anomalies] == ["turns 1-999998 missing (999998 in all)"]


def test_events_of_an_unseen_turn_wait_and_are_placed_once_it_arrives() -> None:
    evs = [turn("t0", 0), call("c1", 1, "k1", outcome="blocked"), summary("m1", 1, 0, 0), end("end", 1)]
    s = assemble(SID, evs, at(100))
    assert codes(s) == [("unknown_turn", "c1"), ("unknown_turn", "m1"), ("unknown_turn", "end")]
    assert s.status == "open" and s.end is None
    assert_nothing_lost(s, evs)
    again = assemble(SID, [*evs, turn("t1", 1)], at(100))
    assert again.anomalies == () and again.status == "completed"
    assert again.turns[1].tool_calls[0].call_id == "k1"


def test_an_event_naming_another_request_than_its_turn_is_set_aside() -> None:
    s = assemble(SID, [turn("t0", 0), call("c0", 0, "k1", req="r7")], at(10))
    assert codes(s) == [("request_mismatch", "c0")]
    assert s.anomalies[0].detail == "tool.call of turn 0 names another request"


def test_tool_call_and_result_anomalies() -> None:
    evs = [turn("t0", 0), turn("t1", 1), turn("t2", 2),
           call("c1", 1, "k1"), call("c1again", 2, "k1"),        # one call id twice
           result("x0", 0, "k1"),                               # returned before it was called
           result("x0b", 2, "k1"),                              # a second result
           result("stray", 2, "never-called"), end("end", 2)]
    s = assemble(SID, evs, at(500))
    assert codes(s) == [("duplicate_call", "c1again"), ("result_before_call", "x0"),
                        ("result_without_call", "stray"), ("duplicate_result", "x0b")]
    assert [r.event_id for r in s.turns[0].tool_results] == ["x0"]  # flagged, still placed
    assert_nothing_lost(s, evs)


def test_results_meet_their_calls_whatever_the_ts() -> None:
    evs = [turn("t0", 0), turn("t1", 1), call("c0", 0, "k1", t=90), result("x1", 1, "k1", t=30), end("e", 1)]
    assert assemble(SID, evs, at(200)).anomalies == ()


def test_summary_anomalies() -> None:
    evs = [*(turn(f"t{i}", i) for i in range(8)), summary("m3", 3, 0, 2), summary("m3b", 3, 1, 2, t=300),
           summary("m6", 6, 2, 5), summary("m7", 7, 6, 6), end("end", 7)]
    s = assemble(SID, evs, at(1000))
    assert codes(s) == [("duplicate_summary", "m3b"), ("summary_overlap", "m6")]
    assert s.anomalies[1].detail == "turn 6 replaces turns the summary of turn 3 replaced"
    # m7 replaces m6's own turn: a summary of a summary, allowed
    assert [t.summary.event_id for t in s.turns if t.summary is not None] == ["m3", "m6", "m7"]


def test_end_anomalies() -> None:
    evs = [turn("t0", 0), turn("t1", 1), turn("t2", 2), end("end", 1), end("end2", 2, "abandoned")]
    s = assemble(SID, evs, at(500))
    assert s.status == "completed" and s.end is not None and s.end.event_id == "end"
    assert codes(s) == [("second_end", "end2"), ("turns_after_end", "end")]
    assert s.anomalies[1].detail == "1 turns after turn 1, the last one by the end"


def test_repeated_event_ids_are_counted_once() -> None:
    evs = [turn("t0", 0), turn("t0", 0), call("c0", 0, "k1"), call("c0", 0, "k1"), result("x", 0, "k1"),
           end("e", 0)]
    s = assemble(SID, evs, at(100))
    assert s.duplicates == 2 and len(s.turns[0].tool_calls) == 1 and s.anomalies == ()


def test_an_empty_session_is_open() -> None:
    s = assemble(SID, [], at(0))
    assert (s.turns, s.status, s.anomalies) == ((), "open", ())


def test_a_hostile_mix_loses_nothing_and_names_no_payload() -> None:
    rng = random.Random(7)
    evs: list[SessionEvent] = [turn(f"t{i}", rng.randrange(40), t=rng.uniform(0, 900),
                                    req=f"secret-req-{rng.randrange(30)}") for i in range(60)]
    evs += [call(f"c{i}", rng.randrange(40), f"secret-call-{rng.randrange(20)}", t=rng.uniform(0, 900),
                 req=f"secret-req-{rng.randrange(30)}") for i in range(60)]
    evs += [result(f"x{i}", rng.randrange(40), f"secret-call-{rng.randrange(20)}", t=rng.uniform(0, 900))
            for i in range(40)]
    evs += [end(f"e{i}", rng.randrange(40), t=rng.uniform(0, 900)) for i in range(3)]
    s = assemble(SID, evs, at(5000))
    assert_nothing_lost(s, evs)
    assert {a.code for a in s.anomalies} <= set(ANOMALIES)
    assert not any("secret" in a.detail or SID in a.detail or "search" in a.detail for a in s.anomalies)


def test_the_anomaly_catalogue_is_disjoint() -> None:
    assert not set(SET_ASIDE) & set(FLAGGED)
