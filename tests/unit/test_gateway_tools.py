"""Tool calling through the gateway's OpenAI API (services/gateway/openai_routes.py): the
official ``openai`` client against the real server and the fake engine (bench/fake_engine.py),
whole and streamed; what the engine is sent; hostile tools refused with 400 before the engine
sees anything; the exposure event's tool-call counts and completion kind."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from bench.fake_engine import FakeEngine
from services.gateway.asgi.app import GatewayServer
from services.gateway.engine_backend import engine_body
from services.gateway.generation import BadRequestError
from services.gateway.models import PolicyBackend
from services.gateway.openai_api import ChatBody
from tests.unit.test_gateway_openai import KEY
from tests.unit.test_gateway_openai import make as make_openai
from tests.unit.test_gateway_relay import backend_on, wait_for

pytestmark = pytest.mark.unit

READ = {"type": "function", "function": {"name": "read_file", "description": "Read a file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"],
    "additionalProperties": False}}}


@pytest.fixture
def served() -> Iterator[tuple[openai.OpenAI, list[dict[str, Any]], FakeEngine]]:
    fake = FakeEngine(token_ms=0.0).start()
    gateway, logged, _ = make_openai(backend_on(fake.base_url))
    srv = GatewayServer(gateway, "127.0.0.1", 0).start()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key=KEY, max_retries=0, timeout=20)
    try:
        yield client, logged, fake
    finally:
        client.close()
        srv.stop(drain_s=1.0)
        fake.stop()


def _ask(client: openai.OpenAI, arguments: str, stream: bool, **extra: Any) -> Any:
    return client.chat.completions.create(
        model="rtrl-policy", user="dev-1", tools=[READ], stream=stream,  # type: ignore[list-item]
        messages=[{"role": "user", "content": arguments}], **extra)


def test_whole_and_streamed_tool_calls_reach_the_client_and_are_validated(served: Any) -> None:
    client, logged, _ = served
    whole = _ask(client, '{"path": "src/app.py"}', stream=False)
    [call] = whole.choices[0].message.tool_calls
    assert call.id.startswith("call_") and len(call.id) == 29
    assert (call.function.name, call.function.arguments) == ("read_file", '{"path": "src/app.py"}')
    assert whole.choices[0].finish_reason == "tool_calls" and whole.choices[0].message.content is None
    chunks = list(_ask(client, '{"path": 7}', stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    first = deltas[0].tool_calls[0]
    assert first.id not in ("", call.id) and first.function.name == "read_file"  # a new id per answer
    assert "".join(d.tool_calls[0].function.arguments or "" for d in deltas) == '{"path": 7}'
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    _ask(client, "not json at all", stream=False)
    text = client.chat.completions.create(model="rtrl-policy", user="dev-1",
                                          messages=[{"role": "user", "content": "hi"}])
    assert text.choices[0].message.tool_calls is None
    wait_for(lambda: len(logged) == 4, 5, "four answers logged")
    seen = [(e["tool_calls"], e["invalid_tool_calls"], e["completion_kind"]) for e in logged]
    assert seen == [(1, 0, "tool_call"), (1, 1, "tool_call"), (1, 1, "tool_call"), (0, 0, "edit")]
    assert all(len(e["completion_tokens"]) == len(e["logprobs"]) > 0 for e in logged)


@pytest.mark.parametrize(("tools", "says"), [
    ([{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}], "$ref cycle"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
     "not a valid JSON Schema"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"$ref": "http://169.254.169.254/"}}}],
     "only references inside"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": {"pattern": "(x+)+\\1"}}}}}], "linear time"),
    ([{"type": "function", "function": {"name": "bad name"}}], "tools.0.function.name"),
    ([{"type": "function", "function": {"name": f"t{i}"}} for i in range(129)], "at most 128 tools"),
])
def test_hostile_tools_are_400_before_the_engine_is_asked(served: Any, tools: Any, says: str) -> None:
    client, logged, fake = served
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="rtrl-policy", user="dev-1", tools=tools,
                                       messages=[{"role": "user", "content": "hi"}])
    body: Any = info.value.body
    assert body["type"] == "invalid_request_error" and says in body["message"], body
    assert fake.posts == 0 and logged == []


def test_tool_history_and_choice_are_forwarded_to_the_engine() -> None:
    body = ChatBody.model_validate({
        "tools": [READ], "tool_choice": {"type": "function", "function": {"name": "read_file"}},
        "parallel_tool_calls": False, "messages": [
            {"role": "user", "content": "open app.py"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "read_file",
                                                                   "arguments": '{"path": "app.py"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "print('hi')"}]})
    sent = engine_body(body.to_request(16), "base", stream=True)
    assert sent["tools"] == [READ] and sent["parallel_tool_calls"] is False
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "read_file"}}
    assert sent["messages"][1] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "read_file", "arguments": '{"path": "app.py"}'}}]}
    assert sent["messages"][2] == {"role": "tool", "content": "print('hi')", "tool_call_id": "call_1"}
    no_tools = engine_body(ChatBody.model_validate({"tool_choice": "none", "messages": [
        {"role": "user", "content": "hi"}]}).to_request(16), "base", stream=False)
    assert "tools" not in no_tools and "tool_choice" not in no_tools


@pytest.mark.parametrize("message", [
    {"role": "tool", "content": "result"},
    {"role": "user", "content": "x",
     "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]},
])
def test_malformed_tool_history_is_refused(message: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="tool"):
        ChatBody.model_validate({"messages": [message]})


def test_a_local_policy_refuses_a_required_tool_call_and_ignores_tools_otherwise() -> None:
    class Never:  # the PolicyBackend checks tool_choice before it touches its policy
        pass

    backend = PolicyBackend.__new__(PolicyBackend)
    backend.tokenizer, backend.vocab_size, backend.policy = None, None, Never()  # type: ignore[assignment]
    required = ChatBody.model_validate({"tools": [READ], "tool_choice": "required",
                                        "messages": [{"role": "user", "content": "hi"}]}).to_request(8)
    with pytest.raises(BadRequestError, match="makes no tool calls"):
        next(backend.stream(required))
    auto = ChatBody.model_validate({"tools": [READ], "messages": [{"role": "user", "content": "hi"}]})
    with pytest.raises(BadRequestError, match="no tokenizer"):  # past the tool check: tools are ignored
        next(backend.stream(auto.to_request(8)))


def test_the_exposure_event_of_a_tool_call_parses_under_the_contract(served: Any) -> None:
    from ingest.events import CompletionServed, parse_event

    client, logged, _ = served
    _ask(client, '{"path": "a.py"}', stream=True)
    wait_for(lambda: len(logged) == 1, 5, "the answer logged")
    event = parse_event(json.dumps({**logged[0], "schema_version": 1, "type": "completion.served",
                                    "ts": logged[0]["ts"].isoformat()}))
    assert isinstance(event, CompletionServed) and event.completion_kind == "tool_call"
    assert (event.tool_calls, event.invalid_tool_calls) == (1, 0)
