"""Join transitions: idempotency, early close, due times, late events and orphans."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from ingest.events import (
    CompletionServed,
    EditAccepted,
    EditPersistence,
    EditRejected,
    Event,
    FollowupDissatisfied,
    ModelRef,
)
from ingest.reward.join import Window, apply, apply_batch, close, close_at, due_at, early_close, supersedes
from ingest.reward.spec import load_spec

SPEC = load_spec()  # horizons 30/600/3600, grace 30, followup 60
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def served(rid: str = "r1", kind: str = "edit", **kw: object) -> CompletionServed:
    return CompletionServed(
        event_id=f"{rid}-s", request_id=rid, ts=T0, session_id="s1", user_key="u1",
        model=ModelRef(name="m", version="3"), arm="canary", prompt_tokens=[1, 2],
        completion_tokens=[3, 4, 5], logprobs=[-0.1, -0.2, -0.3], latency_ms=900,
        completion_kind=kind, **kw,  # type: ignore[arg-type]
    )


def persist(rid: str, h: int, kept: int, eid: str | None = None, dt: int = 0) -> EditPersistence:
    return EditPersistence(event_id=eid or f"{rid}-p{h}", request_id=rid, ts=T0 + timedelta(seconds=h + dt),
                           horizon_s=h, retained_chars=kept, inserted_chars=100)


def run(events: list[Event], now: float = 1000.0) -> Window:
    w: Window | None = None
    for ev in events:
        w = apply(w, ev, now, SPEC)
    assert w is not None
    return w


def test_same_event_twice_changes_nothing() -> None:
    acc = EditAccepted(event_id="a", request_id="r1", ts=T0, inserted_chars=100)
    w1 = run([served(), acc])
    w2 = apply(w1, acc, 2000.0, SPEC)
    assert w2 is w1
    res = apply_batch({"r1": w1}, [], [acc, served()], 3000.0, SPEC)
    assert res.windows == {} and res.duplicates == 2 and res.late == []


def test_full_edit_closes_early_on_last_horizon_and_rewards() -> None:
    w = run([served(), EditAccepted(event_id="a", request_id="r1", ts=T0, inserted_chars=100),
             persist("r1", 30, 100), persist("r1", 600, 60)], now=1000.0)
    assert close_at(w, SPEC) == due_at(w, SPEC) == 1000.0 + 3630.0
    w = apply(w, persist("r1", 3600, 10), 1500.0, SPEC)
    assert close_at(w, SPEC) == 1500.0
    out = close(w, SPEC, 1500.2)
    rec = out.record
    assert rec is not None and out.orphan_events == 0
    assert rec.reward == pytest.approx(0.75 + 0.6)
    assert rec.accepted is True and rec.persistence == {"30": 1.0, "600": 0.6, "3600": 0.1}
    assert rec.reward_spec_version == "default-v1" and not rec.defaulted
    assert rec.behavior_logprobs == [-0.1, -0.2, -0.3] and rec.model.version == "3"


def test_rejection_and_question_close_after_the_followup_window_scaled() -> None:
    rej = EditRejected(event_id="x", request_id="r1", ts=T0)
    w = apply(run([served()], now=100.0), rej, 110.0, SPEC)
    assert close_at(w, SPEC, time_scale=0.5) == 110.0 + 30.0
    q = run([served("q", kind="question")], now=100.0)
    assert close_at(q, SPEC) == 160.0
    rec = close(q, SPEC, 160.0).record
    assert rec is not None and rec.defaulted and rec.accepted is None and rec.reward == 0.0


def test_due_time_uses_the_processing_clock_and_scale() -> None:
    w = run([served()], now=50.0)
    assert due_at(w, SPEC, time_scale=0.01) == pytest.approx(50.0 + 36.3)


def test_latest_decision_wins_and_tie_goes_to_rejection() -> None:
    acc = EditAccepted(event_id="a", request_id="r1", ts=T0, inserted_chars=1)
    rej = EditRejected(event_id="b", request_id="r1", ts=T0)
    later_acc = EditAccepted(event_id="c", request_id="r1", ts=T0 + timedelta(seconds=5), inserted_chars=1)
    assert run([served(), acc, rej]).decision == (T0.timestamp(), False)
    assert run([served(), rej, acc]).decision == (T0.timestamp(), False)
    assert run([served(), rej, later_acc, acc]).decision == (T0.timestamp() + 5, True)


def test_events_for_emitted_requests_are_late_and_never_open_a_window() -> None:
    dis = FollowupDissatisfied(event_id="d", request_id="r9", ts=T0)
    res = apply_batch({}, ["r9"], [dis, served("r2")], 10.0, SPEC)
    assert [e.event_id for e in res.late] == ["d"]
    assert list(res.windows) == ["r2"]


def test_feedback_without_served_expires_as_orphan() -> None:
    w = run([EditAccepted(event_id="a", request_id="r5", ts=T0, inserted_chars=3),
             FollowupDissatisfied(event_id="d", request_id="r5", ts=T0)], now=10.0)
    assert close_at(w, SPEC) == 10.0 + 3630.0
    out = close(w, SPEC, 4000.0)
    assert out.record is None and out.orphan_events == 2


def test_feedback_before_served_still_counts() -> None:
    w = run([EditAccepted(event_id="a", request_id="r1", ts=T0, inserted_chars=3), served()], now=10.0)
    rec = close(w, SPEC, 20.0).record
    assert rec is not None and rec.accepted is True and rec.components["acceptance"] == 0.75


def test_window_round_trips_through_json() -> None:
    w = run([served(tool_calls=2, invalid_tool_calls=1),
             EditRejected(event_id="x", request_id="r1", ts=T0),
             persist("r1", 3600, 5), FollowupDissatisfied(event_id="d", request_id="r1", ts=T0)])
    back = Window.from_json(w.to_json())
    assert back == w
    assert close(back, SPEC, 1.0) == close(w, SPEC, 1.0)


def test_early_close_rules_against_a_table() -> None:
    follow = 3.0
    # (kind, served seen, rejection seen, final horizon seen) -> early close
    table = [
        (None, None, None, 5.0, None),          # nothing served yet: never early
        ("edit", None, 2.0, 5.0, None),
        ("question", 1.0, None, None, 4.0),     # questions and empties wait for a follow-up
        ("empty", 1.0, None, None, 4.0),
        ("edit", 1.0, 2.0, 9.0, 5.0),           # a standing rejection wins over persistence
        ("edit", 1.0, None, 9.0, 9.0),          # final horizon reported: closes then
        ("edit", 6.0, None, 5.0, 6.0),          # ... but not before the served event is seen
        ("edit", 1.0, None, None, None),        # an accepted edit waits for its horizons
    ]
    for kind, served, rejected, final, expected in table:
        assert early_close(kind, served, rejected, final, follow) == expected, (kind, served, rejected, final)


def test_supersedes_latest_wins_rejection_wins_a_tie() -> None:
    assert supersedes(None, 1.0, True)
    assert supersedes((1.0, True), 2.0, True)
    assert not supersedes((2.0, False), 1.0, True)
    assert supersedes((1.0, True), 1.0, False)
    assert not supersedes((1.0, False), 1.0, True)
