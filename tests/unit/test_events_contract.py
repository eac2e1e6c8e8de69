from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
from pydantic import ValidationError

from ingest.events import CompletionServed, EditPersistence, parse_event
from services.cli.events import SCHEMA_PATH, render_schema, validate_lines


def served(**over: object) -> dict[str, object]:
    base: dict[str, object] = {
        "schema_version": 1, "event_id": "e1", "type": "completion.served", "request_id": "r1",
        "ts": "2026-11-22T10:00:00Z", "session_id": "s1", "user_key": "u1",
        "model": {"name": "rtrl-policy", "version": "3"}, "arm": "canary",
        "prompt_tokens": [1, 2], "completion_tokens": [3, 4, 5], "logprobs": [-0.1, -2.0, 0.0],
        "latency_ms": 120.5,
    }
    base.update(over)
    return base


def test_committed_schema_is_current() -> None:
    assert SCHEMA_PATH.read_text() == render_schema(), "run: rtrl events schema --write"


def test_discriminated_parse_and_utc() -> None:
    ev = parse_event(json.dumps(served(ts="2026-11-22T12:00:00+02:00")))
    assert isinstance(ev, CompletionServed)
    assert ev.ts == datetime(2026, 11, 22, 10, 0, tzinfo=UTC)
    assert ev.model.version == "3"


@pytest.mark.parametrize(
    "over",
    [
        {"logprobs": [-0.1]},  # length mismatch
        {"logprobs": [-0.1, 0.5, -1.0]},  # positive logprob
        {"latency_ms": -1},
        {"arm": "blue"},
        {"schema_version": 2},
        {"ts": "2026-11-22T10:00:00"},  # naive time
        {"request_id": ""},
        {"tool_calls": 1, "invalid_tool_calls": 2},
        {"extra": 1},
        {"type": "completion.unknown"},
    ],
)
def test_bad_served_events_rejected(over: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        parse_event(json.dumps(served(**over)))


def test_nan_logprob_rejected() -> None:
    raw = json.dumps(served()).replace("-2.0", "NaN")
    with pytest.raises(ValidationError):
        parse_event(raw)


def test_persistence_retained_cannot_exceed_inserted() -> None:
    with pytest.raises(ValidationError):
        EditPersistence(event_id="e", request_id="r", ts=datetime.now(UTC), horizon_s=60,
                        retained_chars=11, inserted_chars=10)


def test_validate_lines_reports_line_numbers() -> None:
    lines = [json.dumps(served()).encode(), b"", b"{not json", json.dumps(served(arm="x")).encode()]
    ok, bad = validate_lines(lines)
    assert ok == 1
    assert [n for n, _ in bad] == [3, 4]
    assert "arm" in bad[1][1]
