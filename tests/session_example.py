"""The worked example of docs/rewards.md ("Sessions"), as events: docs/examples/session.jsonl,
its turns' served events with the sizes the page gives, their feedback, and the credit per
request the page's table states. Shared by the replay unit tests and the session-stage
integration tests."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from ingest.events import (
    CompletionServed,
    EditAccepted,
    EditPersistence,
    Event,
    FollowupDissatisfied,
    ModelRef,
    parse_event,
)

ROOT = Path(__file__).resolve().parents[1]
TS = datetime(2026, 11, 22, 10, 0, tzinfo=UTC)
SIZES = [(900, 40), (1400, 160), (1600, 30), (1700, 30), (2000, 180), (600, 90)]
"""(prompt tokens, completion tokens) of turns 0-5."""


def served_turn(rid: str, sid: str, prompt: int, completion: int,
                kind: str = "tool_call") -> CompletionServed:
    """A served turn of ``prompt`` and ``completion`` tokens (the reward join does not read its ts)."""
    return CompletionServed(
        event_id=f"{rid}-s", request_id=rid, ts=TS, session_id=sid, user_key=f"u-{rid}",
        model=ModelRef(name="tiny", version="1"), arm="stable", prompt_tokens=[3] * prompt,
        completion_tokens=[4] * completion, logprobs=[-0.5] * completion, latency_ms=500.0,
        completion_kind=kind)  # type: ignore[arg-type]


def worked_example() -> tuple[list[Event], dict[str, float]]:
    """The example's events (session events first, in file order) and its credits by request."""
    session = [parse_event(line) for line in _lines()]
    sid, ts = session[0].session_id, session[0].ts
    events: list[Event] = list(session)
    for i, (p, c) in enumerate(SIZES):
        events.append(served_turn(f"req-7f3a-{i}", sid, p, c, kind="edit" if i in (1, 5) else "tool_call"))
    for rid, kept in (("req-7f3a-1", 80), ("req-7f3a-5", 60)):
        events += [EditAccepted(event_id=f"{rid}-a", request_id=rid, ts=ts, inserted_chars=100),
                   EditPersistence(event_id=f"{rid}-p600", request_id=rid, ts=ts, horizon_s=600,
                                   retained_chars=kept, inserted_chars=100)]
    events.append(FollowupDissatisfied(event_id="req-7f3a-3-d", request_id="req-7f3a-3", ts=ts))
    expected = {f"req-7f3a-{i}": 0.81254 if i == 2 else 1.06254 for i in range(6)}
    return events, expected


def _lines() -> list[str]:
    text = (ROOT / "docs" / "examples" / "session.jsonl").read_text()
    return [line for line in text.splitlines() if line.strip()]
