"""The session events the gateway logs with a turn (services/gateway/chat/turns.py) and the
records that carry them (services/gateway/exposure.exposure_events)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from ingest.events import EVENT_ADAPTER, TURN_MAX, CompletionServed, SessionTurn, ToolCall
from services.gateway.chat import turns
from services.gateway.chat.calls import MAX_CALLS, Invalid
from services.gateway.exposure import ALSO, exposure_events
from services.runtime.spool import store as spool_store

TS = datetime(2026, 12, 5, 12, 0, tzinfo=UTC)


@pytest.mark.parametrize("raw", ["-1", "1e3", "3.0", " 3", "", "0x10", "١٢", str(TURN_MAX + 1), "99999999"])
def test_a_turn_header_that_is_not_a_turn_index_is_refused_with_its_range(raw: str) -> None:
    with pytest.raises(ValueError, match="0 to 999999"):
        turns.turn_header(raw)


@pytest.mark.parametrize(("raw", "turn"), [(None, None), ("0", 0), ("007", 7), (str(TURN_MAX), TURN_MAX)])
def test_a_turn_header_is_read(raw: str | None, turn: int | None) -> None:
    assert turns.turn_header(raw) == turn


@pytest.mark.parametrize(("named", "body", "header", "history", "turn"), [
    (False, 4, None, 2, None),  # the session defaulted to the user: not an agent session
    (True, None, None, None, None),  # a completions request without an index: nothing to go by
    (True, None, None, 0, 0),
    (True, None, None, 3, 3),
    (True, 5, None, 3, 5),  # after a self-summary the history is shorter than the turn index
    (True, None, "5", 3, 5),
    (True, 6, "5", 3, 6),  # the body's index before the header's
    (True, None, None, TURN_MAX + 1, None),
])
def test_the_turn_index(named: bool, body: int | None, header: str | None, history: int | None,
                        turn: int | None) -> None:
    assert turns.turn_of(named, body, header, history) == turn


def test_a_bad_turn_header_is_refused_before_the_session_is_looked_at() -> None:
    with pytest.raises(ValueError, match="X-Rtrl-Turn"):
        turns.turn_of(False, None, "x", 2)


def _call(cid: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}


def test_a_turn_with_calls_gives_valid_contract_events_with_the_ids_the_client_saw() -> None:
    calls = [_call("call_abc", "read_file", '{"path": "a"}'), _call("", "run tests!", "{"),
             _call("x" * 200, "f" * 100, "[]")]
    verdicts: list[Invalid | None] = [None, Invalid("unknown_tool", "no such tool"),
                                      Invalid("not_json", "not an object")]
    fields = turns.session_events("sess-1", "req-9", 3, TS, calls, verdicts)
    events = [EVENT_ADAPTER.validate_python(f) for f in fields]
    turn, made = events[0], [e for e in events[1:] if isinstance(e, ToolCall)]
    assert isinstance(turn, SessionTurn) and len(made) == 3
    assert (turn.session_id, turn.request_id, turn.turn) == ("sess-1", "req-9", 3)
    assert [(e.call_id, e.tool, e.arguments_valid, e.invalid_reason, e.arguments_chars, e.outcome)
            for e in made] == [
        ("call_abc", "read_file", True, None, 13, "dispatched"),
        ("req-9.call1", "run_tests_", False, "unknown_tool", 1, "dispatched"),
        ("req-9.call2", "f" * 64, False, "not_json", 2, "dispatched"),
    ]
    assert len({e.event_id for e in events}) == 4


def test_a_made_call_id_fits_the_contract_for_the_longest_request_id() -> None:
    rid = "r" * 128
    cid = turns.call_id("not an id", rid, MAX_CALLS - 1)
    assert len(cid) <= 128 and cid.endswith(f".call{MAX_CALLS - 1}")


def test_calls_beyond_the_relayed_ones_get_no_event() -> None:
    calls = [_call(f"c{i}", "f", "{}") for i in range(MAX_CALLS + 5)]
    fields = turns.session_events("s", "r", 0, TS, calls, [None] * MAX_CALLS)
    assert len(fields) == 1 + MAX_CALLS


def _served_fields(**over: Any) -> dict[str, Any]:
    return {"event_id": "e1", "request_id": "r1", "ts": TS, "session_id": "s1", "user_key": "u1",
            "model": {"name": "m", "version": "1"}, "arm": "stable", "prompt_tokens": [1],
            "completion_tokens": [2], "logprobs": [-0.1], "latency_ms": 5.0, **over}


def test_a_record_gives_the_events_logged_with_it_then_its_served_event() -> None:
    """The session.turn goes first: the reward worker reads it before the served event, so
    the turn's window cannot close into a per-request reward before its session claims it."""
    also = turns.session_events("s1", "r1", 0, TS, [_call("c1", "f", "{}")], [None])
    events = exposure_events(_served_fields(**{ALSO: also}))
    assert [e.type for e in events] == ["session.turn", "tool.call", "completion.served"]
    assert isinstance(events[-1], CompletionServed)
    assert [e.type for e in exposure_events(_served_fields())] == ["completion.served"]


def test_an_event_that_does_not_fit_is_counted_and_the_served_one_still_goes() -> None:
    counted: list[tuple[str, int]] = []
    bad = {"type": "session.turn", "event_id": "t1", "request_id": "r1", "ts": TS, "session_id": "s1",
           "turn": -1}
    good = {**bad, "event_id": "t2", "turn": 0}
    events = exposure_events(_served_fields(**{ALSO: [bad, good]}), lambda r, n: counted.append((r, n)))
    assert [e.event_id for e in events] == ["t2", "e1"] and counted == [("invalid", 1)]
    with pytest.raises(ValueError):
        exposure_events(_served_fields(latency_ms=-1.0, **{ALSO: [good]}))


def test_a_spooled_record_comes_back_as_the_same_events() -> None:
    """A gateway worker spools the record as JSON (services/runtime/spool/store.py); its
    shipper turns the line back into the events."""
    also = turns.session_events("s1", "r1", 2, TS, [_call("c1", "f", "{}")], [Invalid("not_json", "x")])
    record = _served_fields(**{ALSO: also})
    _, back = spool_store.decode(spool_store.encode(record, 1.0))
    assert exposure_events(back) == exposure_events(record)


def test_an_id_or_a_turn_with_a_trailing_newline_is_not_taken_as_it_is() -> None:
    assert turns.call_id("call_1\n", "r1", 0) == "r1.call0"  # "$" alone would let it through
    with pytest.raises(ValueError):
        turns.turn_header("3\n")
    fields = turns.session_events("s", "r1", 0, TS, [_call("call_1\n", "f", "{}")], [None])
    assert [EVENT_ADAPTER.validate_python(f).type for f in fields] == ["session.turn", "tool.call"]
