"""The tools a chat request declares (OpenAI's ``tools``, ``tool_choice``) and the tool-call
history it carries (assistant ``tool_calls``, ``tool`` messages), checked before anything
reaches the engine.

A request is refused with 400 and a message naming the offending field when a tool list or
schema is too large, nested too deep, not a valid JSON Schema, refers outside itself
(``$ref`` not starting with ``#``), uses a ``pattern`` RE2 cannot run in linear time, or
cannot even be applied to an empty object within the validation budget (a ``$ref`` cycle);
or when ``tool_choice`` names a tool the request does not declare. The bounds below are
per request, whatever the body size limit.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from jsonschema import SchemaError
from jsonschema.protocols import Validator
from pydantic import BaseModel, ConfigDict, Field

from services.gateway.chat import schemas

MAX_TOOLS = 128
"""Tools one request may declare (OpenAI's own limit)."""
MAX_SCHEMA_BYTES = 64 * 1024
"""One tool's ``parameters``, as JSON."""
MAX_TOOLS_BYTES = 512 * 1024
"""All declared tools together, as JSON."""
MAX_SCHEMA_DEPTH = 32
"""Nesting of objects and arrays in one schema."""
MAX_PATTERN_CHARS = 1024
"""One regular expression (``pattern``, a ``patternProperties`` key)."""
NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
"""A function name, as OpenAI allows them."""
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
"""Keywords whose values are instances, not schemas: not searched for refs and patterns."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class FunctionDef(_Strict):
    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    description: Annotated[str, Field(max_length=16_384)] | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class _Name(_Strict):
    name: Annotated[str, Field(pattern=NAME_PATTERN)]


class NamedChoice(_Strict):
    type: Literal["function"]
    function: _Name


ToolChoice = Literal["none", "auto", "required"] | NamedChoice


class CalledFunction(_Strict):
    name: Annotated[str, Field(max_length=256)]
    arguments: Annotated[str, Field(max_length=MAX_SCHEMA_BYTES * 4)]


class PastToolCall(_Strict):
    """A tool call of an earlier assistant turn, as the client sends it back."""

    id: Annotated[str, Field(min_length=1, max_length=256)]
    type: Literal["function"] = "function"
    function: CalledFunction


@dataclass(frozen=True)
class Toolset:
    """What the gateway checks a model's tool calls against (built by :func:`toolset`)."""

    validators: Mapping[str, Validator] = field(default_factory=dict)
    """Declared function name -> a bounded validator of its ``parameters``."""
    choice: str | None = None
    """``none``, ``auto``, ``required``, ``function:<name>``, or None (not given)."""


def toolset(tools: list[Tool] | None, choice: ToolChoice | None) -> Toolset | None:
    """The checked tools of a request (None when it declares none and sets no ``tool_choice``);
    raises ``ValueError`` with a message for the client."""
    if tools is None and choice is None:
        return None
    tools = tools or []
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"tools: at most {MAX_TOOLS} tools per request")
    if len(json.dumps([t.model_dump(exclude_none=True) for t in tools])) > MAX_TOOLS_BYTES:
        raise ValueError(f"tools: more than {MAX_TOOLS_BYTES} bytes of tool definitions")
    validators: dict[str, Validator] = {}
    with schemas.budget(schemas.Budget()):
        for i, tool in enumerate(tools):
            name = tool.function.name
            if name in validators:
                raise ValueError(f"tools[{i}]: the function name {name!r} is declared twice")
            validators[name] = _checked(tool.function.parameters, f"tools[{i}].function.parameters")
    picked = choice if isinstance(choice, str | None) else f"function:{choice.function.name}"
    if isinstance(choice, NamedChoice) and choice.function.name not in validators:
        raise ValueError(f"tool_choice: no tool named {choice.function.name!r} is declared")
    if picked == "required" and not validators:
        raise ValueError("tool_choice: 'required' needs at least one tool")
    return Toolset(validators, picked)


def _checked(parameters: dict[str, Any] | None, where: str) -> Validator:
    """A bounded validator for one function's parameters, after every check of the module doc."""
    schema = {"type": "object"} if parameters is None else parameters
    if len(json.dumps(schema)) > MAX_SCHEMA_BYTES:
        raise ValueError(f"{where}: a schema of more than {MAX_SCHEMA_BYTES} bytes")
    for problem in _walk(schema):
        raise ValueError(f"{where}: {problem}")
    plain, _ = schemas.draft(schema)
    try:
        plain.check_schema(schema)
    except SchemaError as exc:
        path = "/".join(str(p) for p in exc.absolute_path)
        raise ValueError(f"{where}: not a valid JSON Schema{' at ' + path if path else ''}: "
                         f"{exc.message[:200]}") from None
    validator = schemas.bounded_validator(schema)
    try:
        schemas.first_error(validator, {})
    except (schemas.BudgetExceededError, RecursionError):
        raise ValueError(f"{where}: the schema cannot be applied within the validation budget "
                         "(a $ref cycle, or branching that explodes)") from None
    except Exception as exc:  # jsonschema/referencing refuse to apply it (an unresolvable $ref)
        raise ValueError(f"{where}: the schema cannot be applied: {str(exc)[:200]}") from None
    return validator


def _walk(schema: Any) -> Iterator[str]:
    """Problems with a schema's shape, found without recursion: too deep, a ``$ref`` outside
    the schema, a regular expression too long or not runnable by RE2."""
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            yield f"nested deeper than {MAX_SCHEMA_DEPTH} levels"
            return
        if isinstance(node, list):
            stack.extend((item, depth + 1) for item in node)
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            if key in ("$ref", "$dynamicRef", "$recursiveRef") and isinstance(value, str) \
                    and not value.startswith("#"):
                yield f"{key} {value[:80]!r}: only references inside the schema (#...) are followed"
            patterns = [value] if key == "pattern" and isinstance(value, str) else \
                list(value) if key == "patternProperties" and isinstance(value, dict) else []
            for pattern in patterns:
                yield from _pattern_problem(pattern)
            if key not in _DATA_KEYWORDS:
                stack.append((value, depth + 1))


def _pattern_problem(pattern: str) -> Iterator[str]:
    if len(pattern) > MAX_PATTERN_CHARS:
        yield f"a pattern longer than {MAX_PATTERN_CHARS} characters"
        return
    try:
        schemas.compiled(pattern)
    except ValueError as exc:
        yield str(exc)
