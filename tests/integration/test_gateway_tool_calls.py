"""Tool calling through the gateway as it runs (services/wiring/gateway.build: upstream arms,
the Kafka exposure log, the HTTP server) with the official ``openai`` client, against the
fake engine (bench/fake_engine.py) standing in for a vLLM: tool calls relayed whole and
streamed, and every answer's ``completion.served`` on the raw topic, valid under the
contract, with its tool calls counted and its kind."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from pydantic import SecretStr

from bench.fake_engine import FakeEngine
from ingest.events import CompletionServed, parse_event
from services.gateway.asgi.app import GatewayServer
from services.runtime.health import Health
from services.runtime.kafka_io import ensure_topics, make_consumer
from services.settings.model import Settings
from services.settings.services import GatewaySettings, UpstreamSettings
from services.wiring.gateway import build

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
    gw, parts = build(cfg, Health())
    server = GatewayServer(gw, "127.0.0.1", 0).start()
    deadline = time.monotonic() + 10
    while gw.slots.get("stable") is None:
        assert time.monotonic() < deadline, "the upstream never became available"
        time.sleep(0.05)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=KEY, max_retries=0,
                           timeout=30)
    try:
        yield client, cfg
    finally:
        client.close()
        server.stop()
        for part in parts:
            part.stop()
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
