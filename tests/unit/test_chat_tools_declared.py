"""Declared tools (services/gateway/chat/declared.py and schemas.py): what a request may
declare, and hostile schemas refused quickly with a message naming the field."""

from __future__ import annotations

import time
from typing import Any

import pytest
from pydantic import ValidationError

from services.gateway.chat import calls, schemas
from services.gateway.chat.declared import MAX_TOOLS, NamedChoice, Tool, toolset

pytestmark = pytest.mark.unit


def _tool(parameters: Any, name: str = "f") -> Tool:
    return Tool.model_validate({"type": "function", "function": {"name": name, "parameters": parameters}})


def _refused(tools: list[Tool], choice: Any = None) -> str:
    started = time.thread_time()
    with pytest.raises(ValueError, match=r".") as info:
        toolset(tools, choice)
    assert time.thread_time() - started < 2.0, "refused, but only after much CPU"
    return str(info.value)


def _chain(levels: int) -> dict[str, Any]:
    """anyOf branching twice per level through shared $defs: 2^levels paths, each failing."""
    defs: dict[str, Any] = {f"a{i}": {"anyOf": [{"$ref": f"#/$defs/a{i + 1}"}] * 2} for i in range(levels)}
    defs[f"a{levels}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/a0"}


def _deep(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


@pytest.mark.parametrize(("schema", "says"), [
    ({"type": 12}, "not a valid JSON Schema at type"),
    ({"type": "object", "properties": {"a": {"minLength": -1}}}, "not a valid JSON Schema"),
    ({"$ref": "#"}, "a $ref cycle"),
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
     "a $ref cycle"),
    (_chain(40), "within the validation budget"),
    ({"$ref": "https://example.com/schema.json"}, "only references inside the schema"),
    ({"$ref": "#/$defs/missing"}, "cannot be applied"),
    (_deep(40), "nested deeper than 32"),
    ({"type": "string", "pattern": "(a)\\1"}, "cannot run in linear time"),
    ({"type": "string", "pattern": "(?=a)b"}, "cannot run in linear time"),
    ({"type": "string", "pattern": "(a{65535}){65535}"}, "cannot run in linear time"),
    ({"type": "string", "pattern": "a" * 2000}, "a pattern longer than 1024"),
    ({"type": "object", "patternProperties": {"(x)\\1": {}}}, "cannot run in linear time"),
    ({"type": "object", "properties": {"p": {"enum": ["x" * 70_000]}}}, "more than 65536 bytes"),
])
def test_hostile_schemas_are_refused_with_the_field_named(schema: dict[str, Any], says: str) -> None:
    message = _refused([_tool({"type": "object"}, "ok"), _tool(schema)])
    assert message.startswith("tools[1].function.parameters: ") and says in message, message


def test_lists_and_choices_are_bounded_and_consistent() -> None:
    assert f"at most {MAX_TOOLS} tools" in _refused([_tool(None, f"t{i}") for i in range(MAX_TOOLS + 1)])
    assert "declared twice" in _refused([_tool(None), _tool(None)])
    missing = NamedChoice.model_validate({"type": "function", "function": {"name": "g"}})
    assert "no tool named 'g'" in _refused([_tool(None)], missing)
    assert "needs at least one tool" in _refused([], "required")
    assert toolset(None, None) is None
    assert toolset(None, "none") is not None


@pytest.mark.parametrize("bad", [
    {"type": "function", "function": {"name": "has space"}},
    {"type": "function", "function": {"name": "x" * 65}},
    {"type": "function", "function": {"name": "f", "parameters": "a string"}},
    {"type": "code_interpreter"},
    {"type": "function"},
])
def test_malformed_tool_definitions_fail_validation(bad: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        Tool.model_validate(bad)


def test_a_pattern_that_backtracks_forever_in_python_runs_in_linear_time() -> None:
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^(a|a)*$"}}}
    tools = toolset([_tool(schema)], None)
    started = time.thread_time()
    [verdict] = calls.judge(tools, [{"id": "c", "type": "function",
                                     "function": {"name": "f", "arguments": '{"s": "' + "a" * 5000 + '!"}'}}])
    assert verdict is not None and verdict.reason == "schema_mismatch"
    assert time.thread_time() - started < 1.0


def test_draft_07_schemas_are_read_as_draft_07() -> None:
    tuple_items = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
                   "properties": {"pair": {"type": "array",
                                           "items": [{"type": "string"}, {"type": "integer"}]}}}
    tools = toolset([_tool(tuple_items)], None)
    good = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"pair": ["a", 1]}'}}
    bad = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"pair": [1, "a"]}'}}
    assert calls.judge(tools, [good, bad])[0] is None and calls.judge(tools, [bad])[0] is not None


def test_validation_needs_a_budget_and_stops_when_it_runs_out() -> None:
    validator = schemas.bounded_validator(_chain(40))
    with pytest.raises(schemas.BudgetExceededError):
        schemas.first_error(validator, 1)  # no budget at all
    with schemas.budget(schemas.Budget(steps=100, seconds=5.0)), pytest.raises(schemas.BudgetExceededError):
        schemas.first_error(validator, 1)
    with schemas.budget(schemas.Budget()):
        assert schemas.first_error(validator, "fine") is None
