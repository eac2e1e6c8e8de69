"""Agent sessions as events on the events topic, for the session-stage tests: the worked
example of docs/rewards.md and generated sessions of other shapes."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from ingest.events import (
    SessionEnd,
    SessionTurn,
    ToolCall,
)
from ingest.reward.spec import RewardSpec, load_spec
from tests.session_example import served_turn

ROOT = Path(__file__).resolve().parents[2]
AGENT_SPEC = ROOT / "ingest" / "reward" / "specs" / "agent.toml"
T0 = datetime.now(UTC) - timedelta(minutes=5)


def agent_spec() -> RewardSpec:
    return load_spec(AGENT_SPEC)


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
                    served_turn(rid, sid, rng.randint(10, 400), rng.randint(1, 40))]
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
