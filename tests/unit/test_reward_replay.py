"""Replay under another spec: the live windows rebuilt from the events' append times."""

from __future__ import annotations

import math
import random
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from ingest.events import (
    CompletionServed,
    EditAccepted,
    EditPersistence,
    EditRejected,
    Event,
    FollowupDissatisfied,
    ModelRef,
    RewardRecord,
)
from ingest.reward.join import Window, apply, close, close_at
from ingest.reward.replay import Pair, advantage_shift, replay, reproduced, summarize
from ingest.reward.spec import default_spec_text, load_spec, parse_spec
from tests.session_example import served_turn, worked_example

LIVE = load_spec()
NEW = parse_spec(default_spec_text().replace('version = "default-v1"', 'version = "accept-heavy-v2"')
                 .replace("accepted = 0.75", "accepted = 1.5"), "new")
T0 = datetime(2026, 1, 1, tzinfo=UTC)
ROOT = Path(__file__).resolve().parents[2]
SCALE = 0.001  # horizons of 30/600/3600 s pass in 0.03/0.6/3.6 s


def _request(i: int, rng: random.Random) -> list[Event]:
    rid = f"r{i}"
    kind = rng.choice(["edit", "edit", "edit", "question", "empty"])
    out: list[Event] = [CompletionServed(
        event_id=f"{rid}-s", request_id=rid, ts=T0, session_id="s", user_key=f"u{i % 7}",
        model=ModelRef(name="m", version=rng.choice(["1", "2"])), arm=rng.choice(["stable", "canary"]),
        prompt_tokens=[1, 2 + i % 3], completion_tokens=[3, 4], logprobs=[-0.1, -0.2],
        latency_ms=rng.uniform(100, 5000), completion_kind=kind)]
    if kind == "edit" and rng.random() < 0.8:
        accepted = rng.random() < 0.6
        cls = EditAccepted if accepted else EditRejected
        out.append(cls(event_id=f"{rid}-d", request_id=rid, ts=T0 + timedelta(seconds=1), inserted_chars=100))
        if accepted:
            for h in (30, 600, 3600):
                if rng.random() < 0.8:
                    out.append(EditPersistence(event_id=f"{rid}-p{h}", request_id=rid,
                                               ts=T0 + timedelta(seconds=h), horizon_s=h,
                                               retained_chars=rng.randrange(0, 101), inserted_chars=100))
    if rng.random() < 0.2:
        out.append(FollowupDissatisfied(event_id=f"{rid}-f", request_id=rid, ts=T0, reason="wrong"))
    return out


def _live_run(n: int, seed: int, lag_s: float = 0.0) -> tuple[list[tuple[float, Event]], list[RewardRecord]]:
    """What the live worker does: events appended over time, each applied ``lag_s`` after its
    append, windows closed at close_at on the processing clock. Returns the appended events and
    the records emitted."""
    rng = random.Random(seed)
    appended: list[tuple[float, Event]] = []
    for i in range(n):
        start = 1000.0 + i * 0.05
        for j, ev in enumerate(_request(i, rng)):
            # the broker's append time, in whole milliseconds as Kafka keeps it
            appended.append((round(start + j * rng.uniform(0.0, 1.5), 3), ev))
    appended.sort(key=lambda te: te[0])
    windows: dict[str, Window] = {}
    records: list[RewardRecord] = []
    closed: set[str] = set()
    clock = [t + lag_s for t, _ in appended]
    for (_, ev), now in zip(appended, clock, strict=True):
        for rid, w in list(windows.items()):  # close what is due before this event is applied
            if close_at(w, LIVE, SCALE) <= now:
                rec = close(w, LIVE, close_at(w, LIVE, SCALE)).record
                if rec is not None:
                    records.append(rec)
                closed.add(rid)
                del windows[rid]
        if ev.request_id in closed:
            continue  # late
        windows[ev.request_id] = apply(windows.get(ev.request_id), ev, now, LIVE)
    for w in windows.values():
        rec = close(w, LIVE, close_at(w, LIVE, SCALE)).record
        if rec is not None:
            records.append(rec)
    return appended, records


def test_replay_with_the_live_spec_reproduces_every_live_record() -> None:
    appended, records = _live_run(300, seed=1)
    result = replay(appended, records, LIVE)
    assert len(result.pairs) == len(records) > 250
    assert all(reproduced(p) for p in result.pairs)
    assert result.missing_served == 0
    assert result.after_close > 0, "some events came after their window closed (late live, left out here)"


def test_replay_under_a_new_spec_changes_only_the_reward_and_names_the_new_version() -> None:
    appended, records = _live_run(300, seed=2)
    result = replay(appended, records, NEW)
    assert {p.replayed.reward_spec_version for p in result.pairs} == {"accept-heavy-v2"}
    for p in result.pairs:
        live, new = p.live.model_dump(), p.replayed.model_dump()
        for key in ("reward", "components", "reward_spec_version"):
            live.pop(key), new.pop(key)
        assert live == new, "same windows, same feedback: only the reward differs"
        bonus = 0.75 if p.live.accepted else 0.0  # acceptance went from 0.75 to 1.5
        assert p.replayed.reward == pytest.approx(p.live.reward + bonus)
    s = summarize(result.pairs)
    accepted = sum(1 for p in result.pairs if p.live.accepted)
    assert s["records"] == len(records) and s["changed"] == accepted > 0
    assert s["mean_replayed"] == pytest.approx(s["mean_live"] + 0.75 * accepted / len(records))  # type: ignore[operator]
    by = s["by_version_arm"]
    assert sum(row["records"] for row in by) == len(records)  # type: ignore[attr-defined,index]


def test_a_lagging_live_worker_is_reported_as_not_reproduced() -> None:
    """An event appended before the close but read after it was late live: the replay includes
    it, so that record does not reproduce (and the check says so)."""
    appended, records = _live_run(300, seed=3, lag_s=0.4)
    result = replay(appended, records, LIVE)
    assert any(not reproduced(p) for p in result.pairs)


def test_events_without_a_live_record_are_counted_not_replayed() -> None:
    appended, records = _live_run(50, seed=4)
    kept = records[:20]
    result = replay(appended, kept, LIVE)
    assert len(result.pairs) == 20 and result.without_live_record > 0


def test_advantage_shift_against_hand_values() -> None:
    s = advantage_shift([0.5, -0.5, 0.0, 1.0], [0.25, 0.5, 0.0, 1.0])
    assert s["mean_abs_change"] == pytest.approx((0.25 + 1.0) / 4)
    assert s["sign_flip_share"] == pytest.approx(0.25)
    assert math.isnan(advantage_shift([], [])["sign_flip_share"])


def _pair(i: int, arm: str, live_reward: float, new_reward: float) -> Pair:
    served_at = T0 + timedelta(seconds=10 + i)
    rec = RewardRecord(
        request_id=f"{arm}{i}", served_event_id=f"e{arm}{i}", session_id="s", user_key=f"{arm}-u{i}",
        served_ts=served_at, closed_ts=served_at + timedelta(seconds=5),
        model=ModelRef(name="m", version="1" if arm == "stable" else "2"), arm=arm,  # type: ignore[arg-type]
        prompt_tokens=[1, 2], completion_tokens=[3, 4], behavior_logprobs=[-0.1, -0.2], latency_ms=500.0,
        completion_kind="edit", accepted=True, persistence={"600": 0.8}, reward=live_reward,
        components={"acceptance": live_reward}, reward_spec_version="default-v1")
    return Pair(rec, rec.model_copy(update={"reward": new_reward, "reward_spec_version": "v2"}))


def test_a_past_canary_is_judged_again_with_the_replayed_rewards() -> None:
    from rollback.types import JudgePolicy
    from services.cli.replay import canaries

    rng = random.Random(5)
    pairs = [_pair(i, "stable", r, r) for i in range(400) for r in [rng.gauss(0.5, 0.2)]]
    pairs += [_pair(i, "canary", r, r - 1.0) for i in range(400) for r in [rng.gauss(0.5, 0.2)]]
    row = {"canary_id": "canary-v2", "candidate": "2", "stable": "1", "outcome": "promoted",
           "started_ms": T0.timestamp() * 1000, "decided_at": (T0 + timedelta(seconds=900)).isoformat()}
    undecided = {**row, "canary_id": "canary-v3", "decided_at": ""}
    holdout = {**row, "canary_id": "holdout-v1-x", "kind": "holdout"}  # no canary: not judged
    refused = {**row, "canary_id": "refused-x", "kind": "refused_command"}
    [out] = canaries(pairs, [row, undecided, holdout, refused], JudgePolicy())
    assert out["canary_id"] == "canary-v2" and out["live"]["verdict"] != "rollback"
    assert out["replayed"]["verdict"] == "rollback" and out["changed"]
    assert out["live"]["reward_difference"] == pytest.approx(0.0, abs=0.1)
    assert out["replayed"]["reward_difference"] == pytest.approx(-1.0, abs=0.1)
    assert out["live"]["users"] == [400, 400]


# ------------------------------------------------------------------ sessions
def test_replay_measures_advantages_as_the_trainer_groups_them() -> None:
    """Session turns are grouped by session, as the trainer does: two sessions of three turns
    (live returns +1 and -1) give advantages of +1 and -1; replayed with both returning +1, every
    advantage is 0. Grouped per turn in window order (three turns a group), every live
    advantage would be 0 and the replay would seem to change nothing."""
    from ingest.events import CreditedSession
    from services.cli.replay import advantages
    from services.settings.model import Settings

    pairs = []
    for k, (sid, live, new) in enumerate([("a", 1.0, 1.0), ("b", -1.0, 1.0)]):
        for turn in range(3):
            p = _pair(3 * k + turn, "stable", live, new)
            credited = CreditedSession(turn=turn, turns=3, status="completed", invalid_tool_calls=0,
                                       lead=turn == 0)
            upd = {"session_id": sid, "session_credit": credited}
            pairs.append(Pair(p.live.model_copy(update=upd), p.replayed.model_copy(update=upd)))
    settings = Settings.model_validate({"trainer": {"group_size": 3}})
    assert advantages(pairs, settings) == {"mean_abs_change": pytest.approx(1.0), "sign_flip_share": 1.0}


def _worked_example() -> tuple[list[tuple[float, Event]], dict[str, float]]:
    """docs/rewards.md's worked example and a request of no session, appended one per 10 ms."""
    events, expected = worked_example()
    events.append(served_turn("plain", "sess-7f3a", 50, 5))
    return [(100.0 + 0.01 * k, ev) for k, ev in enumerate(events)], expected


def test_a_session_spec_replays_turns_with_their_session_credit() -> None:
    events, expected = _worked_example()
    agent = load_spec(ROOT / "ingest" / "reward" / "specs" / "agent.toml")
    windows: dict[str, Window] = {}
    for t, ev in events:
        windows[ev.request_id] = apply(windows.get(ev.request_id), ev, t, LIVE)
    live = [r for w in windows.values() if (r := close(w, LIVE, 200.0).record) is not None]
    assert {r.request_id for r in live} == {*expected, "plain"}
    res = replay(events, live, agent)
    got = {p.replayed.request_id: p.replayed for p in res.pairs}
    for rid, value in expected.items():
        assert got[rid].reward == pytest.approx(value, abs=1e-9), rid
        assert got[rid].reward_spec_version == "agent-v1" and "outcome" in got[rid].components
    assert "outcome" not in got["plain"].components  # not a turn: rewarded per request
    again = replay(events, [p.replayed for p in res.pairs], agent)  # the credited records, replayed
    assert all(reproduced(p) for p in again.pairs)
    assert all(reproduced(p) for p in replay(events, live, LIVE).pairs)  # no [session]: per request
