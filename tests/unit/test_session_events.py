"""The session events of contract revision 1.1 (ingest/events.py): each event on its own
through ingest's validator (reason codes for hostile fields), HMAC, dedup and keying in the
ingest transform, the per-request reward join left as it was, and the worked examples of
docs/events.md checked against the models, the committed JSON Schema and the CLI."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from kafka.structs import TopicPartition
from kafka_fakes import Rec
from pydantic import SecretStr

from ingest.adapters.memory import MemoryDedupStore
from ingest.auth import AuthPolicy, sign
from ingest.events import CompletionServed, EditAccepted, Event, ModelRef, SessionEvent, parse_event
from ingest.reward.join import apply_batch, close
from ingest.reward.sessions import assemble_all
from ingest.reward.spec import load_spec
from ingest.validate import Accepted, Limits, Rejected, validate
from services.cli import events as cli
from services.settings.model import AuthSettings, Settings

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "docs" / "examples" / "session.jsonl"
HOSTILE = ROOT / "docs" / "examples" / "session-hostile.jsonl"
NOW = datetime(2026, 11, 22, 10, 0, tzinfo=UTC)
SECRET = b"k"
AUTH = AuthPolicy(keys={"gw": SECRET})


def ev(type_: str = "tool.call", **over: object) -> dict[str, Any]:
    base: dict[str, Any] = {"schema_version": 1, "event_id": "e1", "type": type_, "request_id": "r1",
                            "ts": "2026-11-22T09:59:00Z", "session_id": "s1", "turn": 3}
    base.update({
        "session.turn": {},
        "tool.call": {"call_id": "c1", "tool": "run_tests", "arguments_valid": True, "outcome": "dispatched"},
        "tool.result": {"call_id": "c1", "status": "ok", "result_tokens": 12},
        "session.summary": {"replaced_from": 0, "replaced_to": 2, "summary_tokens": 90},
        "session.end": {"outcome": "completed"},
    }.get(type_, {}))
    base.update(over)
    return base


def check(obj: object, key: bytes | None = b"r1", secret: bytes = SECRET) -> Accepted | Rejected:
    value = json.dumps(obj).encode()
    headers: list[tuple[str, bytes | None]] = [("rtrl-key-id", b"gw"),
                                               ("rtrl-signature", sign(value, secret).encode())]
    return validate(value, headers, key, NOW, Limits(), AUTH)


TYPES = ["session.turn", "tool.call", "tool.result", "session.summary", "session.end"]


@pytest.mark.parametrize("type_", TYPES)
def test_each_session_type_passes_ingest(type_: str) -> None:
    out = check(ev(type_))
    assert isinstance(out, Accepted) and out.event.type == type_


@pytest.mark.parametrize(("over", "reason", "detail"), [
    ({"turn": "3"}, "invalid_field", "turn: Input should be a valid integer"),
    ({"turn": 3.0}, "invalid_field", "turn: Input should be a valid integer"),
    ({"turn": -1}, "invalid_field", "turn: Input should be greater than or equal to 0"),
    ({"turn": 1_000_000}, "invalid_field", "turn: Input should be less than or equal to 999999"),
    ({"turn": 2**70}, "invalid_field", "turn: Input should be less than or equal to 999999"),
    ({"arguments_valid": "yes"}, "invalid_field", "arguments_valid: Input should be a valid boolean"),
    ({"arguments_valid": 1}, "invalid_field", "arguments_valid: Input should be a valid boolean"),
    ({"tool": "x" * 65}, "invalid_field", "tool: String should have at most 64 characters"),
    ({"tool": "rm -rf /"}, "invalid_field", "tool: String should match pattern"),
    ({"call_id": "c" * 129}, "invalid_field", "call_id: String should have at most 128 characters"),
    ({"session_id": ["s1"]}, "invalid_field", "session_id: Input should be a valid string"),
    ({"arguments_chars": 2**63}, "invalid_field", "arguments_chars: Input should be less than or equal to"),
    ({"arguments_valid": False}, "invalid_field", "invalid_reason is required when arguments_valid is false"),
    ({"invalid_reason": "not_json"}, "invalid_field", "must be null when it is true"),
    ({"outcome": "exploded"}, "invalid_field", "outcome: Input should be 'dispatched' or 'blocked'"),
    ({"arguments": {"path": "/etc/passwd"}}, "invalid_field",
     "<unknown field>: Extra inputs are not permitted"),
    ({"turn": None}, "invalid_field", "turn: Input should be a valid integer"),
])
def test_hostile_tool_call_fields_get_their_reason(over: dict[str, object], reason: str, detail: str) -> None:
    out = check(ev(**over))
    assert isinstance(out, Rejected) and out.reason == reason, out
    assert detail in out.detail
    assert "/etc/passwd" not in out.detail and "rm -rf" not in out.detail


@pytest.mark.parametrize(("type_", "over", "reason", "detail"), [
    ("session.summary", {"replaced_to": 3}, "invalid_field", "replaced_from <= replaced_to < turn"),
    ("session.summary", {"replaced_from": 2, "replaced_to": 1}, "invalid_field",
     "replaced_from <= replaced_to"),
    ("session.summary", {"summary_tokens": -5}, "invalid_field", "summary_tokens"),
    ("session.end", {"outcome": "exploded"}, "invalid_field", "outcome"),
    ("tool.result", {"status": "fine"}, "invalid_field", "status"),
    ("tool.result", {"result_tokens": "12"}, "invalid_field",
     "result_tokens: Input should be a valid integer"),
    ("session.turn", {"session_id": None}, "invalid_field", "session_id"),
    ("session.turn", {"session_id": "s" * 10_000}, "invalid_field", "session_id: String should have at most"),
])
def test_hostile_session_fields_get_their_reason(type_: str, over: dict[str, object], reason: str,
                                                 detail: str) -> None:
    out = check(ev(type_, **over))
    assert isinstance(out, Rejected) and out.reason == reason and detail in out.detail, out


def test_missing_session_fields_and_the_envelope_rules_are_v1s() -> None:
    missing = check({k: v for k, v in ev("session.turn").items() if k != "session_id"})
    assert isinstance(missing, Rejected) and (missing.reason, missing.detail) == ("missing_field",
                                                                                 "session_id: Field required")
    assert getattr(check(ev(), key=b"s1"), "reason", None) == "key_mismatch"  # keyed by request_id, as v1
    assert getattr(check(ev(), secret=b"other"), "reason", None) == "bad_signature"
    assert getattr(check(ev(schema_version=2)), "reason", None) == "unknown_schema_version"
    huge = ev("session.turn", padding="x" * 300_000)
    assert getattr(check(huge), "reason", None) == "oversized"


def test_ingest_forwards_session_events_keyed_by_request_and_drops_repeats() -> None:
    from services.wiring.ingest import IngestTransform

    settings = Settings(auth=AuthSettings(keys={"gw": SecretStr("k")}))
    transform = IngestTransform(settings, MemoryDedupStore(60), clock=lambda: NOW)
    values = [json.dumps(ev("session.turn", event_id="t3")).encode(), json.dumps(ev()).encode(),
              json.dumps(ev()).encode(), json.dumps(ev(turn="x")).encode()]
    recs = [Rec(i, v, b"r1", [("rtrl-key-id", b"gw"), ("rtrl-signature", sign(v, b"k").encode())],
                topic=settings.topics.raw) for i, v in enumerate(values)]
    batch = transform.transform({TopicPartition(settings.topics.raw, 0): recs}, [])
    assert [(o.topic, o.key) for o in batch.outputs] == [
        (settings.topics.events, b"r1"), (settings.topics.events, b"r1"), (settings.topics.dlq, b"r1")]
    counts = batch.result
    assert (counts.valid, counts.duplicate, dict(counts.rejected)) == (2, 1, {"invalid_field": 1})
    assert parse_event(batch.outputs[1].value).type == "tool.call"


def test_the_per_request_reward_is_the_same_with_session_events() -> None:
    spec = load_spec()
    served = CompletionServed(event_id="s", request_id="r1", ts=NOW, session_id="s1", user_key="u1",
                              model=ModelRef(name="m", version="3"), arm="canary", prompt_tokens=[1],
                              completion_tokens=[2], logprobs=[-0.5], latency_ms=100, tool_calls=1)
    accepted = EditAccepted(event_id="a", request_id="r1", ts=NOW, inserted_chars=10)
    session: list[Event] = [parse_event(json.dumps(ev(t, event_id=f"x-{t}", ts="2026-11-22T10:00:00Z")))
                            for t in ("session.turn", "tool.call", "tool.result", "session.end")]
    plain = apply_batch({}, [], [served, accepted], 10.0, spec).windows["r1"]
    mixed = apply_batch({}, [], [session[0], served, *session[1:], accepted], 10.0, spec).windows["r1"]
    assert close(mixed, spec, 99.0).record == close(plain, spec, 99.0).record


# ---------------------------------------------------------------------- the worked examples
def lines(path: Path) -> list[bytes]:
    return [line for line in path.read_bytes().splitlines() if line.strip()]


@pytest.mark.parametrize("path", [EXAMPLE, HOSTILE], ids=["example", "hostile"])
def test_example_files_are_valid_events_under_the_committed_schema(path: Path) -> None:
    schema = json.loads(cli.SCHEMA_PATH.read_text())
    validator = jsonschema.Draft202012Validator(schema)
    for raw in lines(path):
        validator.validate(json.loads(raw))
    valid, bad = cli.parse_lines(lines(path))
    assert bad == [] and all(isinstance(e, SessionEvent) for e in valid)


def test_the_worked_example_assembles_as_docs_events_md_says() -> None:
    valid, _ = cli.parse_lines(lines(EXAMPLE))
    events = [e for e in valid if isinstance(e, SessionEvent)]
    (sid, s), = assemble_all(events, max(e.ts for e in events)).items()
    assert (sid, s.status, s.anomalies, s.set_aside) == ("sess-7f3a", "completed", (), ())
    assert [(t.index, t.request_id) for t in s.turns] == [(i, f"req-7f3a-{i}") for i in range(6)]
    assert [[c.tool for c in t.tool_calls] for t in s.turns] == [
        ["search"], ["edit_file"], ["run_tests"], ["run_tests"], [], []]
    assert [c.invalid_reason for t in s.turns for c in t.tool_calls] == [None, None, "not_json", None]
    assert [[(r.call_id, r.status) for r in t.tool_results] for t in s.turns] == [
        [], [("call-1", "ok")], [("call-2", "ok")], [], [("call-4", "error")], []]
    summary = s.turns[4].summary
    assert summary is not None
    assert (summary.replaced_from, summary.replaced_to, summary.summary_tokens) == (0, 3, 180)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = cli.main(["validate", *argv])
    return code, capsys.readouterr().out


def test_the_cli_output_shown_in_the_docs_is_what_it_prints(capsys: pytest.CaptureFixture[str]) -> None:
    docs = (ROOT / "docs" / "events.md").read_text()
    code, out = run_cli(capsys, str(EXAMPLE), "--sessions")
    assert code == 0 and out == "15 valid, 0 invalid\nsession sess-7f3a: completed, 6 turns\n"
    assert out in docs
    code, out = run_cli(capsys, str(HOSTILE), "--sessions", "--idle-s", "300")
    assert code == 1 and out in docs
    code, out = run_cli(capsys, str(HOSTILE))  # per line only, as before
    assert (code, out) == (0, "10 valid, 0 invalid\n")


def test_the_cli_json_lists_sessions(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_cli(capsys, str(HOSTILE), "--sessions", "--json")
    doc = json.loads(out)
    assert code == 1 and doc["valid"] == 10 and doc["invalid"] == []
    assert [(s["session_id"], s["status"], s["turns"], s["set_aside"]) for s in doc["sessions"]] == [
        ("sess-b01", "open", 2, 3), ("sess-b02", "abandoned", 1, 1)]
    assert doc["sessions"][1]["anomalies"][0] == {
        "code": "request_in_other_session", "event_id": "bad-e08",
        "detail": "turn 0: the request is a turn of another session"}
