"""Chat answers, pure: the kind of an answer (services/gateway/chat/classify.py), tool calls
assembled from an engine's deltas and judged against the declared schemas
(services/gateway/chat/calls.py), each against plain hand-written expectations."""

from __future__ import annotations

from typing import Any

import pytest

from services.gateway.chat import calls
from services.gateway.chat.classify import answer_kind
from services.gateway.chat.declared import NamedChoice, Tool, toolset

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("text", "tool_calls", "refusal", "finish", "kind"), [
    ("", 1, None, "tool_calls", "tool_call"),
    ("Let me look at the file first.", 2, None, "tool_calls", "tool_call"),
    ("Which file?", 1, None, "tool_calls", "tool_call"),
    ("", 0, None, "stop", "empty"),
    ("  \n\t", 0, None, "stop", "empty"),
    ("I cannot help with that.", 0, "I cannot help with that.", "stop", "empty"),
    ("partial", 0, None, "content_filter", "empty"),
    ("```python\nx = 1\n```\nShould I also update the tests?", 0, None, "stop", "edit"),
    ("~~~\nfix\n~~~", 0, None, "stop", "edit"),
    ("Which file do you mean?", 0, None, "stop", "question"),
    ("Do you want the sync or the async version?", 0, None, "stop", "question"),
    ("which", 0, None, "stop", "question"),
    ("which sort", 0, None, "length", "question"),
    ("**How** should errors be reported", 0, None, "stop", "question"),
    ("Replace the loop with sum(xs).", 0, None, "stop", "edit"),
    ("add sort list key", 0, None, "length", "edit"),
    ("Whichever you prefer works: use sorted().", 0, None, "stop", "edit"),
    ("The answer?\nNo: use sorted().", 0, None, "stop", "edit"),
    ("I'm sorry, but I cannot help with that.", 0, None, "stop", "empty"),
    ("I'm sorry, but I cannot help with that.", 2, None, "tool_calls", "tool_call"),
])
def test_answer_kind(text: str, tool_calls: int, refusal: str | None, finish: str, kind: str) -> None:
    assert answer_kind(text, tool_calls, refusal, finish) == kind


@pytest.mark.parametrize("text", [
    "I can't help with that.",
    "I cannot assist with this request.",
    "I’m sorry, but I can’t provide that.",
    "I'm sorry, but I cannot comply with that request.",
    "Sorry, I won't do that.",
    "I am sorry. I will not help with this.",
    "Unfortunately, I'm unable to assist with that.",
    "I'm afraid I won't be able to help with that.",
    "I must decline this request.",
    "As an AI, I won't write malware.",
    "As an AI language model, I cannot browse the internet.",
    "**I can't help with that.**",
    "I can't help with that. Is there anything else I can help you with?",
    "  i  cannot   do that!\n",
])
def test_a_refusal_in_prose_is_empty(text: str) -> None:
    assert answer_kind(text, 0, None, "stop") == "empty"


@pytest.mark.parametrize(("text", "kind"), [
    ("I can't reproduce this, but here is a fix:\n```python\nxs.sort()\n```", "edit"),
    ("I can't help with that.\n```sh\nrm -rf build\n```", "edit"),
    ("I can't reproduce this, but the fix is to use sorted().", "edit"),
    ("Sorry for the delay -- here is the patch: replace the loop with sum(xs).", "edit"),
    ("Sorry, but the test fails because the list is empty.", "edit"),
    ("I cannot help but notice the loop is quadratic: use a set.", "edit"),
    ("I can't do that for you. Instead, call sorted(xs).", "edit"),
    ("I can't help with the CI, however the bug is on line 3.", "edit"),
    ("As an AI, I can't run your code, but the error is on line 3.", "edit"),
    ("I can provide a fix: use sorted().", "edit"),
    ("I won't repeat the whole file: change line 3 to return xs.", "edit"),
    ("I can't help with that. " + "The config is read from the environment first. " * 6, "edit"),
    ("Can't you use X?", "question"),
    ("I can't help you without the file: which one is it?", "question"),
    ("Sorry, but I can't see the attachment. Could you paste it?", "question"),
    ("Which file? I can't help without it.", "question"),
    ("Why can't you use sorted()", "question"),
])
def test_near_refusals_keep_their_kind(text: str, kind: str) -> None:
    assert answer_kind(text, 0, None, "stop") == kind


def _tool(name: str, parameters: dict[str, Any] | None) -> Tool:
    return Tool.model_validate({"type": "function", "function": {"name": name, "parameters": parameters}})


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": "c1", "type": "function", "function": {"name": name, "arguments": arguments}}


READ = _tool("read_file", {"type": "object", "properties": {
    "path": {"type": "string", "pattern": "^[a-z/]+\\.py$"}, "line": {"type": "integer", "minimum": 1}},
    "required": ["path"], "additionalProperties": False})
SEARCH = _tool("search", None)


@pytest.mark.parametrize(("call", "reason"), [
    (_call("read_file", '{"path": "src/a.py"}'), None),
    (_call("read_file", '{"path": "src/a.py", "line": 3}'), None),
    (_call("search", '{"anything": [1, 2]}'), None),
    (_call("search", "{}"), None),
    (_call("write_file", '{"path": "a.py"}'), "unknown_tool"),
    (_call("read_file", '{"path": "a.py"'), "not_json"),
    (_call("read_file", "path=a.py"), "not_json"),
    (_call("read_file", ""), "not_json"),
    (_call("read_file", '["a.py"]'), "not_json"),
    (_call("read_file", '{"path": NaN}'), "not_json"),
    (_call("read_file", "[" * 100_000), "not_json"),
    (_call("read_file", '{"path": "' + "a" * 300_000 + '"}'), "not_json"),
    (_call("read_file", "{}"), "schema_mismatch"),
    (_call("read_file", '{"path": "A.PY"}'), "schema_mismatch"),
    (_call("read_file", '{"path": "a.py", "line": 0}'), "schema_mismatch"),
    (_call("read_file", '{"path": "a.py", "mode": "r"}'), "schema_mismatch"),
])
def test_a_call_is_judged_against_the_declared_schema(call: dict[str, Any], reason: str | None) -> None:
    [verdict] = calls.judge(toolset([READ, SEARCH], None), [call])
    assert (None if verdict is None else verdict.reason) == reason, verdict


def test_tool_choice_limits_what_a_call_may_name() -> None:
    named = NamedChoice.model_validate({"type": "function", "function": {"name": "search"}})
    ok = _call("read_file", '{"path": "a.py"}')
    assert calls.judge(toolset([READ, SEARCH], "required"), [ok]) == [None]
    [other] = calls.judge(toolset([READ, SEARCH], named), [ok])
    [none] = calls.judge(toolset([READ, SEARCH], "none"), [ok])
    [undeclared] = calls.judge(None, [ok])
    assert other and none and undeclared
    assert (other.reason, none.reason, undeclared.reason) == ("unknown_tool",) * 3


def test_count_is_calls_and_invalid_ones() -> None:
    tools = toolset([READ], None)
    made = [_call("read_file", '{"path": "a.py"}'), _call("read_file", "oops"), _call("nope", "{}")]
    assert calls.count(tools, made) == (3, 2)
    assert calls.count(tools, []) == (0, 0)
    many = [_call("read_file", '{"path": "a.py"}')] * (calls.MAX_CALLS + 1)
    assert calls.count(tools, many) == (calls.MAX_CALLS + 1, 1)


def test_stream_deltas_assemble_into_whole_calls() -> None:
    assembled: list[dict[str, Any]] = []
    stream = [
        [{"index": 0, "id": "call_a", "type": "function",
          "function": {"name": "read_file", "arguments": ""}}],
        [{"index": 0, "function": {"arguments": '{"path": '}}],
        [{"index": 1, "id": "call_b", "type": "function", "function": {"name": "search"}}],
        [{"index": 0, "function": {"arguments": '"a.py"}'}}, {"index": 1, "function": {"arguments": "{}"}}],
    ]
    for raw in stream:
        calls.merge(assembled, calls.deltas(raw))
    assert calls.client_calls(assembled) == [
        {"id": "call_a", "type": "function",
         "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "search", "arguments": "{}"}},
    ]


def test_an_engines_odd_tool_calls_are_reduced_to_strings() -> None:
    assert calls.deltas(None) == [] and calls.deltas("x") == [] and calls.deltas({"a": 1}) == []
    whole = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": {"k": 1}}}, 7,
             {"index": -3, "function": {"name": 5, "arguments": None}}, {"index": 10_000, "id": "z"}]
    assert calls.deltas(whole) == [
        {"index": 0, "id": "c", "type": "function", "function": {"name": "f", "arguments": '{"k": 1}'}},
        {"index": 2},
        {"index": calls.MAX_CALLS, "id": "z", "type": "function", "function": {}},
    ]
