"""Agent sessions as events on the events topic, for the session-stage tests: the worked
example of docs/rewards.md and generated sessions of other shapes."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from reward_helpers import served

from ingest.events import (
    EditAccepted,
    EditPersistence,
    FollowupDissatisfied,
    SessionEnd,
    SessionTurn,
    ToolCall,
    parse_event,
)
from ingest.reward.spec import RewardSpec, load_spec

ROOT = Path(__file__).resolve().parents[2]
AGENT_SPEC = ROOT / "ingest" / "reward" / "specs" / "agent.toml"
T0 = datetime.now(UTC) - timedelta(minutes=5)


def agent_spec() -> RewardSpec:
    return load_spec(AGENT_SPEC)


def turn_served(rid: str, sid: str, prompt: int, completion: int, kind: str = "tool_call", **kw: Any) -> Any:
    return served(rid, kind=kind, prompt_tokens=[3] * prompt, completion_tokens=[4] * completion,
                  logprobs=[-0.5] * completion, session_id=sid, **kw)


def worked_example() -> tuple[list[Any], dict[str, float]]:
    """docs/examples/session.jsonl with the facts docs/rewards.md gives its turns, as events;
    and the credit per request the page's table states."""
    lines = (ROOT / "docs" / "examples" / "session.jsonl").read_text().splitlines()
    session = [parse_event(line) for line in lines if line.strip()]
    sid = session[0].session_id
    sizes = [(900, 40), (1400, 160), (1600, 30), (1700, 30), (2000, 180), (600, 90)]
    events: list[Any] = list(session)
    for i, (p, c) in enumerate(sizes):
        rid = f"req-7f3a-{i}"
        events.append(turn_served(rid, sid, p, c, kind="edit" if i in (1, 5) else "tool_call"))
    for rid, kept in (("req-7f3a-1", 80), ("req-7f3a-5", 60)):
        events += [EditAccepted(event_id=f"{rid}-a", request_id=rid, ts=T0, inserted_chars=100),
                   EditPersistence(event_id=f"{rid}-p600", request_id=rid, ts=T0, horizon_s=600,
                                   retained_chars=kept, inserted_chars=100)]
    events.append(FollowupDissatisfied(event_id="req-7f3a-3-d", request_id="req-7f3a-3", ts=T0))
    expected = {f"req-7f3a-{i}": 1.06254 for i in range(6)}
    expected["req-7f3a-2"] = 0.81254
    return events, expected


def generated(n: int, seed: int, turn_first: bool = False
              ) -> tuple[list[list[Any]], dict[str, str], set[str]]:
    """``n`` sessions of 1-5 tool-calling turns, some ended, some left to time out, some with
    an invalid call. Each request's events are one stream (its ``session.turn`` beside its
    ``completion.served``, as the serving layer sends them, in either order), a session's end
    another (``turn_first``: the turn always before the served event). Returns the streams,
    every served request's session, and the requests whose session is ended."""
    rng = random.Random(seed)
    streams: list[list[Any]] = []
    owner: dict[str, str] = {}
    ended: set[str] = set()
    for s in range(n):
        sid = f"gs{seed}-{s}"
        turns = rng.randint(1, 5)
        for t in range(turns):
            rid = f"{sid}-r{t}"
            owner[rid] = sid
            ts = T0 + timedelta(seconds=10 * t)
            pair = [SessionTurn(event_id=f"{rid}-t", request_id=rid, ts=ts, session_id=sid, turn=t),
                    turn_served(rid, sid, rng.randint(10, 400), rng.randint(1, 40))]
            if not turn_first:
                rng.shuffle(pair)
            valid = rng.random() > 0.2
            call = ToolCall(event_id=f"{rid}-c", request_id=rid, ts=ts, session_id=sid, turn=t,
                            call_id=f"c{t}", tool="search", arguments_valid=valid, arguments_chars=20,
                            outcome="blocked",
                            **({} if valid else {"invalid_reason": "not_json"}))  # type: ignore[arg-type]
            streams.append([*pair, call])
        if rng.random() < 0.7:
            last = turns - 1
            streams.append([SessionEnd(event_id=f"{sid}-end", request_id=f"{sid}-r{last}",
                                  ts=T0 + timedelta(seconds=10 * turns), session_id=sid, turn=last,
                                  outcome=rng.choice(["completed", "abandoned", "handed_back"]))])
            ended |= {r for r, o in owner.items() if o == sid}
    return streams, owner, ended
