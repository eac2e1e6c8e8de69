"""Tool calling through the gateway as it runs (services/wiring/gateway.build: upstream arms,
the Kafka exposure log, the HTTP server) with the official ``openai`` client, against the
fake engine (bench/fake_engine.py) standing in for a vLLM: tool calls relayed whole and
streamed, and every answer's ``completion.served`` on the raw topic, valid under the
contract, with its tool calls counted and its kind."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest
from pydantic import SecretStr

from bench.fake_engine import FakeEngine
from ingest.events import CompletionServed, SessionTurn, ToolCall, parse_event
from services.runtime.kafka_io import ensure_topics, make_consumer
from services.settings.model import Settings
from services.settings.services import GatewaySettings, UpstreamSettings
from tests.gateway_inproc import openai_gateway

pytestmark = pytest.mark.integration

KEY = "sk-tools-test"

TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "read_file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string", "pattern": "^[\\w/.-]+$"}},
        "required": ["path"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "run", "parameters": {
        "type": "object", "required": ["argv"],
        "properties": {"argv": {"type": "array", "items": {"type": "string"}, "minItems": 1}}}}},
]


@pytest.fixture
def gateway(settings: Settings) -> Iterator[tuple[openai.OpenAI, Settings]]:
    engine = FakeEngine(token_ms=1.0).start()
    cfg = settings.model_copy(update={"gateway": GatewaySettings(**{
        "port": 0, "key_id": None, "api_keys": {"team": SecretStr(KEY)},
        "stable_upstream": UpstreamSettings(base_url=engine.url, model="team-model")})})
    ensure_topics(cfg, [cfg.topics.raw])
    try:
        with openai_gateway(cfg, KEY) as client:
            yield client, cfg
    finally:
        engine.stop()


def _served(cfg: Settings, n: int) -> dict[str, CompletionServed]:
    consumer = make_consumer(cfg.kafka, None, [cfg.topics.raw])
    events: dict[str, CompletionServed] = {}
    deadline = time.monotonic() + 30
    try:
        while len(events) < n and time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=200).values():
                for rec in batch:
                    event = parse_event(rec.value)
                    if isinstance(event, CompletionServed):
                        events[event.request_id] = event
    finally:
        consumer.close()
    return events


def test_tool_calls_relayed_whole_and_streamed_and_logged_under_the_contract(
        gateway: tuple[openai.OpenAI, Settings]) -> None:
    client, cfg = gateway
    asks = {  # request id -> (what the fake engine is made to call with, stream, tool_choice)
        "tools-valid": ('{"path": "src/app.py"}', False, None),
        "tools-bad-pattern": ('{"path": "a b.py"}', True, None),
        "tools-not-json": ("{'path': 'a.py'}", False, None),
        "tools-named-run": ('{"argv": ["pytest", "-q"]}', True,
                            {"type": "function", "function": {"name": "run"}}),
    }
    for rid, (arguments, stream, choice) in asks.items():
        extra: dict[str, Any] = {} if choice is None else {"tool_choice": choice}
        answer = client.chat.completions.create(
            model="team-model", user="agent-1", tools=TOOLS, stream=stream, extra_body={"request_id": rid},
            messages=[{"role": "user", "content": arguments}], **extra)
        if stream:
            chunks = list(answer)  # type: ignore[arg-type]
            parts = [c.choices[0].delta.tool_calls[0].function.arguments or ""
                     for c in chunks if c.choices and c.choices[0].delta.tool_calls]
            assert "".join(parts) == arguments and chunks[-1].choices[0].finish_reason == "tool_calls"
        else:
            [call] = answer.choices[0].message.tool_calls  # type: ignore[union-attr]
            assert call.function.arguments == arguments and call.function.name == "read_file"
    plain = client.chat.completions.create(model="team-model", user="agent-1",
                                           extra_body={"request_id": "plain"},
                                           messages=[{"role": "user", "content": "hello"}])
    assert plain.choices[0].message.content
    events = _served(cfg, len(asks) + 1)
    seen = {rid: (e.tool_calls, e.invalid_tool_calls, e.completion_kind) for rid, e in events.items()}
    assert seen == {"tools-valid": (1, 0, "tool_call"), "tools-bad-pattern": (1, 1, "tool_call"),
                    "tools-not-json": (1, 1, "tool_call"), "tools-named-run": (1, 0, "tool_call"),
                    "plain": (0, 0, "edit")}


def test_a_hostile_tool_list_is_400_and_nothing_is_logged(gateway: tuple[openai.OpenAI, Settings]) -> None:
    client, _ = gateway
    loop = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
    with pytest.raises(openai.BadRequestError, match="validation budget"):
        client.chat.completions.create(
            model="team-model", user="agent-1", messages=[{"role": "user", "content": "hi"}],
            tools=[{"type": "function", "function": {"name": "f", "parameters": loop}}])


def _raw(cfg: Settings, until: Callable[[list[Any]], bool]) -> list[Any]:
    """The raw topic's events, read until ``until(events)`` holds (30 s at most)."""
    consumer = make_consumer(cfg.kafka, None, [cfg.topics.raw])
    events: list[Any] = []
    deadline = time.monotonic() + 30
    try:
        while not until(events) and time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=200).values():
                events += [parse_event(rec.value) for rec in batch]
    finally:
        consumer.close()
    return events


def test_a_named_session_logs_each_turn_and_each_tool_call_with_its_verdict(
        gateway: tuple[openai.OpenAI, Settings]) -> None:
    """An agent loop as the official client runs one: ask, get a call, send its result back
    with the history, get the next call. The turn index comes from the history, or from the
    client when a self-summary shortened it; a session defaulted to the user has no turns."""
    client, cfg = gateway
    sid = f"sess-{uuid.uuid4().hex[:8]}"
    history: list[Any] = []
    seen: dict[str, list[Any]] = {}  # request id -> the calls the client got
    for t, (arguments, stream) in enumerate([('{"path": "src/app.py"}', False), ("{'path'", True),
                                             ('{"path": "b c"}', False)]):
        history.append({"role": "user", "content": arguments})  # the fake engine calls with these
        rid = f"{sid}-r{t}"
        answer: Any = client.chat.completions.create(
            model="team-model", user="agent-7", tools=TOOLS, stream=stream, messages=history,
            extra_body={"session_id": sid, "request_id": rid})
        if stream:
            deltas = [c.choices[0].delta for c in answer if c.choices and c.choices[0].delta.tool_calls]
            call = {"id": deltas[0].tool_calls[0].id, "function": {
                "name": deltas[0].tool_calls[0].function.name,
                "arguments": "".join(d.tool_calls[0].function.arguments or "" for d in deltas)}}
        else:
            got = answer.choices[0].message.tool_calls[0]
            call = {"id": got.id, "function": {"name": got.function.name,
                                               "arguments": got.function.arguments}}
        seen[rid] = [call]
        history += [{"role": "assistant", "content": None, "tool_calls": [{"type": "function", **call}]},
                    {"role": "tool", "tool_call_id": call["id"], "content": "ok"}]
    # a self-summary replaced turns 0-2: three messages, but this is turn 4 (the header says so)
    summary: Any = [{"role": "user", "content": "summary of turns 0-2"}]
    client.chat.completions.create(model="team-model", user="agent-7", messages=summary,
                                   extra_headers={"X-Rtrl-Session-Id": sid, "X-Rtrl-Turn": "4"},
                                   extra_body={"request_id": f"{sid}-r4"})
    client.chat.completions.create(model="team-model", user="agent-7", messages=summary,
                                   extra_body={"request_id": f"{sid}-plain"})  # no named session
    for bad in ("-1", "2.0", "1000000"):
        with pytest.raises(openai.BadRequestError, match="X-Rtrl-Turn must be"):
            client.chat.completions.create(model="team-model", user="agent-7", messages=summary,
                                           extra_headers={"X-Rtrl-Session-Id": sid, "X-Rtrl-Turn": bad})
    for turn in ("3", True, -1, 1_000_000):
        with pytest.raises(openai.BadRequestError, match="turn"):
            client.chat.completions.create(model="team-model", user="agent-7", messages=summary,
                                           extra_body={"session_id": sid, "turn": turn})

    def done(events: list[Any]) -> bool:
        return sum(isinstance(e, CompletionServed) and e.request_id.startswith(sid) for e in events) >= 5

    events = [e for e in _raw(cfg, done) if e.request_id.startswith(sid)]
    turn_of = {e.request_id: e.turn for e in events if isinstance(e, SessionTurn)}
    assert turn_of == {f"{sid}-r0": 0, f"{sid}-r1": 1, f"{sid}-r2": 2, f"{sid}-r4": 4}
    assert all(e.session_id == sid for e in events if isinstance(e, SessionTurn | ToolCall))
    made = {e.request_id: (e.call_id, e.turn, e.tool, e.arguments_valid, e.invalid_reason, e.outcome)
            for e in events if isinstance(e, ToolCall)}
    assert made == {
        f"{sid}-r0": (seen[f"{sid}-r0"][0]["id"], 0, "read_file", True, None, "dispatched"),
        f"{sid}-r1": (seen[f"{sid}-r1"][0]["id"], 1, "read_file", False, "not_json", "dispatched"),
        f"{sid}-r2": (seen[f"{sid}-r2"][0]["id"], 2, "read_file", False, "schema_mismatch", "dispatched"),
    }
    served_ids = {e.request_id for e in events if isinstance(e, CompletionServed)}
    assert served_ids == {f"{sid}-r{t}" for t in (0, 1, 2, 4)} | {f"{sid}-plain"}
