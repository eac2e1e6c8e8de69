"""The session stage of the reward worker against the real broker and Redis (in a thread):
agent sessions credited per turn, exactly one record per served request."""

from __future__ import annotations

import collections
import random
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from reward_helpers import interleave, produce, read_rewards, served
from session_helpers import T0, agent_spec, generated

from ingest.events import SessionEnd, SessionTurn
from ingest.reward.session_credit import COMPONENTS
from services.runtime.process import Stopper
from services.settings.model import Settings
from services.settings.services import RewardSettings
from services.wiring.reward import RewardWorker
from tests.session_example import served_turn, worked_example


@pytest.fixture
def worker(settings: Settings, request: pytest.FixtureRequest) -> Iterator[Settings]:
    # 0.001: a request window (3630 s) lasts 3.6 s, an idle session (1800 s) times out in 1.8 s,
    # a tool call's request (closed after the 60 s follow-up wait) in 0.06 s
    scale = getattr(request, "param", 0.001)
    s = settings.model_copy(update={"reward": RewardSettings(time_scale=scale, poll_timeout_ms=100)})
    w = RewardWorker(s, agent_spec()).start()
    stopper = Stopper()
    t = threading.Thread(target=w.run, args=(stopper,), daemon=True)
    t.start()
    yield s
    stopper.stop()
    t.join(15)
    assert not t.is_alive(), "the worker did not stop"
    w.close()


def _turn(rid: str, sid: str, turn: int, seconds: int = 0) -> SessionTurn:
    return SessionTurn(event_id=f"{rid}-t-{sid}", request_id=rid, ts=T0 + timedelta(seconds=seconds),
                       session_id=sid, turn=turn)


def test_the_worked_example_and_every_other_request_get_one_record_each(worker: Settings) -> None:
    s = worker
    example, expected = worked_example()
    others: list[Any] = [
        served("plain-1", kind="question"),  # not a session turn: its own record, as before
        # a turn index claimed twice: the second request is set aside, keeps its own record
        _turn("c-0", "conflict", 0), served_turn("c-0", "conflict", 10, 2),
        _turn("c-1", "conflict", 0, seconds=5), served_turn("c-1", "conflict", 10, 2),
        SessionEnd(event_id="c-end", request_id="c-0", ts=T0, session_id="conflict", turn=0,
                   outcome="abandoned"),
        # one request claimed by two sessions: the first claim seen gets it
        _turn("shared-0", "first", 0), served_turn("shared-0", "first", 10, 2),
        SessionEnd(event_id="first-end", request_id="shared-0", ts=T0, session_id="first", turn=0,
                   outcome="completed"),
        # a session.turn after its request's record is out: that record stays its only one
        served_turn("late-0", "late", 10, 2, kind="question"),
        # no session.end: times out (outcome 0.0)
        _turn("idle-0", "idle", 0), served_turn("idle-0", "idle", 1000, 0 + 10),
    ]
    rng = random.Random(5)
    shuffled = example[:]
    rng.shuffle(shuffled)
    produce(s, [*shuffled, *others, *example[:3]])  # and a few repeated events
    produce(s, [_turn("shared-0", "second", 0, seconds=1)])  # after the first claim
    served_ids = set(expected) | {"plain-1", "c-0", "c-1", "shared-0", "idle-0", "late-0"}
    time.sleep(1.0)  # late-0, a question, closes 0.06 s after it was seen
    produce(s, [_turn("late-0", "late", 0), SessionEnd(event_id="late-end", request_id="late-0", ts=T0,
                                                        session_id="late", turn=0, outcome="completed")])
    records = read_rewards(s, expect=len(served_ids), timeout_s=60, settle_s=3)
    counts = collections.Counter(r["request_id"] for r in records)
    assert set(counts) == served_ids and max(counts.values()) == 1, counts
    by = {r["request_id"]: r for r in records}
    for rid, value in expected.items():
        assert by[rid]["reward"] == pytest.approx(value, abs=1e-9), rid
        assert set(by[rid]["components"]) == set(COMPONENTS)
        assert by[rid]["reward_spec_version"] == "agent-v1" and by[rid]["session_id"] == "sess-7f3a"
    assert by["req-7f3a-1"]["accepted"] is True and by["req-7f3a-1"]["persistence"] == {"600": 0.8}
    assert "outcome" not in by["plain-1"]["components"]  # per-request terms
    assert by["c-0"]["components"]["outcome"] == -0.5  # abandoned
    assert "outcome" not in by["c-1"]["components"]  # set aside: its per-request record
    assert by["shared-0"]["components"]["outcome"] == 1.0  # the first claimer's completed session
    assert "outcome" not in by["late-0"]["components"]
    for i in range(6):  # the session as the judge's per-session metrics read it, once, at turn 0
        assert by[f"req-7f3a-{i}"]["session_credit"] == {
            "turn": i, "turns": 6, "status": "completed", "invalid_tool_calls": 1, "lead": i == 0}
    assert by["plain-1"]["session_credit"] is None and by["c-1"]["session_credit"] is None
    assert by["idle-0"]["session_credit"]["status"] == "timed_out"
    idle = by["idle-0"]["components"]
    assert idle["outcome"] == 0.0 and idle["tokens"] == pytest.approx(-0.002 * 1010 / 1000)


@pytest.mark.parametrize("worker", [0.005], indirect=True)  # a 0.3 s follow-up wait: a turn's
def test_generated_sessions_in_any_interleaving(worker: Settings) -> None:  # events arrive in it
    s = worker
    streams, owner, ended = generated(40, seed=101)
    produce(s, interleave(streams, random.Random(7)))  # across requests and partitions, any order
    records = read_rewards(s, expect=len(owner), timeout_s=90, settle_s=3)
    counts = collections.Counter(r["request_id"] for r in records)
    assert set(counts) == set(owner) and max(counts.values()) == 1
    by_session: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for r in records:
        assert set(r["components"]) == set(COMPONENTS), r["request_id"]
        by_session[owner[r["request_id"]]].append(r)
    for sid, recs in by_session.items():
        shared = {k: v for k, v in recs[0]["components"].items() if k != "invalid_tool_calls"}
        assert all({k: v for k, v in r["components"].items() if k != "invalid_tool_calls"} == shared
                   for r in recs), sid  # every turn carries the whole return
        assert shared["turns"] == pytest.approx(-0.02 * len(recs))
        if recs[0]["request_id"] not in ended:
            assert shared["outcome"] == 0.0  # timed out
