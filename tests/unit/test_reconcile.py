"""The reconciler's accounting (ingest/reward/reconcile.py) on plain hand-built topic contents."""

from __future__ import annotations

from datetime import UTC, datetime

from ingest.events import EditPersistence
from ingest.reward.reconcile import (
    DeadLetter,
    ForwardedEvent,
    RawRecord,
    RewardSeen,
    Timing,
    reconcile,
)

RAW = "raw"


def fwd(off: int, eid: str, rid: str, typ: str, src: int | None = None, *, part: int = 0,
        t_ms: int = 1_000, ts: float = 0.0, kind: str | None = None, horizon: int | None = None
        ) -> ForwardedEvent:
    return ForwardedEvent(
        partition=part, offset=off, event_id=eid, request_id=rid, type=typ,
        source=None if src is None else f"{RAW}:0:{src}", timestamp_ms=t_ms, ts=ts,
        completion_kind=kind if kind is not None else ("edit" if typ == "completion.served" else None),
        horizon_s=horizon)


def accepted_edit(rid: str, first_raw: int, first_off: int) -> tuple[list[RawRecord], list[ForwardedEvent]]:
    """served, accepted, persistence at 3600 s: closed by its events."""
    ids = [f"{rid}-s", f"{rid}-a", f"{rid}-p"]
    raw = [RawRecord(0, first_raw + i, eid) for i, eid in enumerate(ids)]
    f = [fwd(first_off, ids[0], rid, "completion.served", first_raw),
         fwd(first_off + 1, ids[1], rid, "edit.accepted", first_raw + 1),
         fwd(first_off + 2, ids[2], rid, "edit.persistence", first_raw + 2, horizon=3600)]
    return raw, f


def test_a_clean_run_accounts_for_everything() -> None:
    raw_a, fwd_a = accepted_edit("a", 0, 0)
    raw_b, fwd_b = accepted_edit("b", 3, 3)
    raw = [*raw_a, *raw_b, RawRecord(0, 6, None), RawRecord(0, 7, "b-a")]  # junk; a retried send
    dlq = [DeadLetter("bad_json", RAW, 0, 6)]
    rep = reconcile(raw, [*fwd_a, *fwd_b], dlq, [RewardSeen("a"), RewardSeen("b")], raw_topic=RAW)
    assert rep.ok and rep.all_reflected
    counts = (rep.raw_records, rep.raw_forwarded, rep.raw_dead_lettered, rep.raw_duplicates_dropped)
    assert counts == (8, 6, 1, 1)
    assert rep.dead_lettered_by_reason == {"bad_json": 1}
    assert (rep.requests_served, rep.reward_records, rep.lost, rep.duplicated) == (2, 2, 0, 0)
    assert "verdict: OK" in rep.render()


def test_a_raw_record_in_neither_topic_is_lost() -> None:
    raw, f = accepted_edit("a", 0, 0)
    rep = reconcile([*raw, RawRecord(0, 3, "x-s")], f, [], [RewardSeen("a")], raw_topic=RAW)
    assert rep.raw_lost == ["0:3"]
    assert not rep.ok and not rep.all_reflected and rep.lost == 1
    assert "LOST                1  0:3" in rep.render()


def test_unprocessed_raw_records_are_pending_not_lost() -> None:
    raw, f = accepted_edit("a", 0, 0)
    rep = reconcile([*raw, RawRecord(0, 3, "x-s")], f, [], [RewardSeen("a")], raw_topic=RAW,
                    ingest_committed={0: 3})
    assert rep.raw_lost == [] and rep.raw_pending == 1
    assert rep.ok and not rep.all_reflected


def test_an_event_forwarded_twice_and_a_record_handled_twice_are_duplicates() -> None:
    raw, f = accepted_edit("a", 0, 0)
    again = fwd(3, "a-a", "a", "edit.accepted", 1)  # the same raw record forwarded again
    dead_too = DeadLetter("bad_json", RAW, 0, 2)     # and one both forwarded and dead-lettered
    rep = reconcile(raw, [*f, again], [dead_too], [RewardSeen("a")], raw_topic=RAW)
    assert rep.duplicate_forwarded == {"a-a": 2}
    assert rep.raw_double_handled == ["0:1", "0:2"]
    assert rep.duplicated == 3 and not rep.ok


def test_two_reward_records_for_one_request_are_duplicates() -> None:
    raw, f = accepted_edit("a", 0, 0)
    rep = reconcile(raw, f, [], [RewardSeen("a", 0, 0), RewardSeen("a", 0, 9)], raw_topic=RAW)
    assert rep.duplicate_rewards == {"a": 2}
    assert rep.reward_records == 2 and rep.rewarded_requests == 1
    assert not rep.ok


def test_a_request_closed_by_its_events_without_a_reward_is_a_lost_reward() -> None:
    raw_a, fwd_a = accepted_edit("a", 0, 0)
    rejected = [fwd(3, "r-s", "r", "completion.served"), fwd(4, "r-x", "r", "edit.rejected")]
    question = [fwd(5, "q-s", "q", "completion.served", kind="question")]
    rep = reconcile(raw_a, [*fwd_a, *rejected, *question], [], [], raw_topic=RAW)
    assert rep.lost_rewards == ["a", "q", "r"]
    assert rep.forwarded_without_raw == 0  # the rejected/question events have no source header
    assert not rep.ok and not rep.all_reflected


def test_an_accepted_edit_still_waiting_for_horizons_is_open_not_lost() -> None:
    f = [fwd(0, "e-s", "e", "completion.served"), fwd(1, "e-a", "e", "edit.accepted"),
         fwd(2, "e-p", "e", "edit.persistence", horizon=600)]
    rep = reconcile([], f, [], [], raw_topic=RAW)
    assert rep.lost_rewards == [] and rep.open_requests == 1
    assert rep.ok and not rep.all_reflected


def test_the_latest_decision_wins_and_a_tie_goes_to_reject() -> None:
    # accepted after a rejection: an open edit (waits for persistence), not closed
    later_accept = [fwd(0, "x-s", "x", "completion.served"), fwd(1, "x-r", "x", "edit.rejected", ts=1.0),
                    fwd(2, "x-a", "x", "edit.accepted", ts=2.0)]
    tie = [fwd(3, "y-s", "y", "completion.served"), fwd(4, "y-a", "y", "edit.accepted", ts=1.0),
           fwd(5, "y-r", "y", "edit.rejected", ts=1.0)]
    rep = reconcile([], [*later_accept, *tie], [], [], raw_topic=RAW)
    assert rep.lost_rewards == ["y"] and rep.open_requests == 1


def test_with_a_clock_rewards_are_due_only_after_followup_window_and_slack() -> None:
    t = Timing(now_ms=10_000, window_ms=100_000, followup_ms=3_000, slack_ms=2_000)
    q_old = [fwd(0, "q1-s", "q1", "completion.served", t_ms=4_000, kind="question")]   # due 7 s + 2 s
    q_new = [fwd(1, "q2-s", "q2", "completion.served", t_ms=6_000, kind="question")]   # due 9 s + 2 s
    open_edit = [fwd(2, "e-s", "e", "completion.served", t_ms=1_000)]
    rep = reconcile([], [*q_old, *q_new, *open_edit], [], [], raw_topic=RAW, timing=t)
    assert rep.lost_rewards == ["q1"] and rep.open_requests == 2
    late = Timing(now_ms=200_000, window_ms=100_000, followup_ms=3_000, slack_ms=2_000)
    rep = reconcile([], [*q_old, *q_new, *open_edit], [], [], raw_topic=RAW, timing=late)
    assert rep.lost_rewards == ["e", "q1", "q2"]  # the edit's window expired at its due time


def test_a_session_turn_is_open_until_its_session_could_have_closed() -> None:
    turn = [fwd(0, "t-s", "t", "completion.served", t_ms=4_000, kind="tool_call"),
            fwd(1, "t-turn", "t", "session.turn", t_ms=4_000)]
    plain = [fwd(2, "p-s", "p", "completion.served", t_ms=4_000, kind="tool_call")]
    t = Timing(now_ms=50_000, window_ms=100_000, followup_ms=3_000, slack_ms=2_000, session_ms=60_000)
    rep = reconcile([], [*turn, *plain], [], [], raw_topic=RAW, timing=t)
    assert rep.lost_rewards == ["p"] and rep.open_requests == 1  # due at 4 + 60 s + 2 s slack
    later = Timing(now_ms=66_001, window_ms=100_000, followup_ms=3_000, slack_ms=2_000, session_ms=60_000)
    assert reconcile([], turn, [], [], raw_topic=RAW, timing=later).lost_rewards == ["t"]
    per_request = Timing(now_ms=50_000, window_ms=100_000, followup_ms=3_000, slack_ms=2_000)
    assert reconcile([], turn, [], [], raw_topic=RAW, timing=per_request).lost_rewards == ["t"]


def test_events_the_reward_group_has_not_committed_are_not_judged() -> None:
    q = [fwd(0, "q1-s", "q1", "completion.served", kind="question", part=1)]
    rep = reconcile([], q, [], [], raw_topic=RAW, reward_committed={1: 0})
    assert rep.lost_rewards == [] and rep.open_requests == 1
    rep = reconcile([], q, [], [], raw_topic=RAW, reward_committed={1: 1})
    assert rep.lost_rewards == ["q1"]


def test_feedback_without_served_is_an_orphan_not_a_lost_reward() -> None:
    f = [fwd(0, "o-a", "o", "edit.accepted"), fwd(1, "o-p", "o", "edit.persistence", horizon=3600)]
    rep = reconcile([], f, [], [], raw_topic=RAW)
    assert rep.orphan_requests == ["o"] and rep.lost_rewards == []
    assert rep.ok and not rep.all_reflected and rep.unreflected_events == 2


def test_dead_letters_count_by_reason_and_foreign_sources_separately() -> None:
    raw = [RawRecord(0, i) for i in range(3)]
    dlq = [DeadLetter("bad_json", RAW, 0, 0), DeadLetter("unsigned", RAW, 0, 1),
           DeadLetter("unsigned", RAW, 0, 2), DeadLetter("bad_json", "other", 0, 0)]
    rep = reconcile(raw, [], dlq, [], raw_topic=RAW)
    assert rep.dead_lettered_by_reason == {"bad_json": 1, "unsigned": 2}
    assert rep.raw_dead_lettered == 3 and rep.dlq_other_source == 1 and rep.dlq_records == 4
    assert rep.ok and rep.all_reflected


def test_unparseable_forwarded_records_are_counted() -> None:
    rep = reconcile([], [ForwardedEvent(0, 0, None)], [], [], raw_topic=RAW)
    assert rep.forwarded_unparseable == 1 and rep.forwarded_events == 1
    d = rep.to_dict()
    assert d["ok"] is True and d["lost"] == 0 and d["forwarded_unparseable"] == 1


def test_forwarded_event_of_built_from_a_contract_event() -> None:
    ev = EditPersistence(event_id="p", request_id="r", ts=datetime(2026, 1, 1, tzinfo=UTC), horizon_s=3600,
                         retained_chars=1, inserted_chars=2)
    f = ForwardedEvent.of(ev, 2, 7, "raw:2:9", 123)
    assert (f.type, f.horizon_s, f.source, f.timestamp_ms, f.completion_kind) == (
        "edit.persistence", 3600, "raw:2:9", 123, None)
