"""The tool calls of an engine's chat answer: read from its messages and stream deltas,
assembled, and checked against the tools the request declared.

An engine answers OpenAI's shapes: a whole message carries ``tool_calls`` ``[{id, type,
function: {name, arguments}}]``; a stream carries deltas ``[{index, id?, type?, function:
{name?, arguments?}}]`` whose ``arguments`` are pieces of one JSON text, concatenated per
``index``. :func:`deltas` reduces either to the delta shape (strings only; anything else the
engine adds is dropped), :func:`merge` assembles them, :func:`verdict` judges one call.

A call is **valid** when it names a declared function (the one ``tool_choice`` names, if it
names one; none at all when ``tool_choice`` is ``none``), its ``arguments`` are at most
:data:`MAX_ARGUMENT_BYTES` of JSON (``json``, RFC 8259: no NaN) holding an object, and that
object matches the function's ``parameters`` schema within the validation budget. Anything
else is **invalid**, with a reason; nothing a model writes makes validation raise.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Literal

from services.gateway.chat import schemas
from services.gateway.chat.declared import Toolset

log = logging.getLogger(__name__)

MAX_CALLS = 128
"""Tool calls relayed and validated per answer; the calls of an engine that sends more are
not relayed past this and count as one more invalid call."""
MAX_ARGUMENT_BYTES = 256 * 1024
"""One call's ``arguments``; longer ones are invalid without being parsed."""


def _text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict | list):  # a server that sends parsed arguments
        return json.dumps(value)
    return None


def deltas(raw: Any) -> list[dict[str, Any]]:
    """An engine's ``tool_calls`` (a whole message's or a stream delta's) in the delta shape;
    ``[]`` when there are none or they are not a list."""
    if not isinstance(raw, list):
        return []
    out = []
    for position, call in enumerate(raw[:MAX_CALLS + 1]):
        if not isinstance(call, dict):
            continue
        index = call.get("index", position)
        index = index if isinstance(index, int) and not isinstance(index, bool) and index >= 0 else position
        fn: dict[str, Any] = call["function"] if isinstance(call.get("function"), dict) else {}
        delta: dict[str, Any] = {"index": min(index, MAX_CALLS)}
        if isinstance(call.get("id"), str):
            delta["id"] = call["id"]
        if call.get("type") is not None or "id" in delta:
            delta["type"] = "function"
        function = {k: text for k in ("name", "arguments") if (text := _text(fn.get(k))) is not None}
        if function or "id" in delta:
            delta["function"] = function
        out.append(delta)
    return out


def merge(calls: list[dict[str, Any]], pieces: list[dict[str, Any]]) -> None:
    """Add stream deltas (or a whole message's calls) to the assembled ``calls``, in place."""
    for piece in pieces:
        index = piece["index"]
        while len(calls) <= index:
            calls.append({"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
        call = calls[index]
        if piece.get("id"):
            call["id"] = piece["id"]
        fn = piece.get("function") or {}
        if fn.get("name") and not call["function"]["name"]:
            call["function"]["name"] = fn["name"]
        call["function"]["arguments"] += fn.get("arguments") or ""


def client_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The assembled calls as OpenAI's whole message shows them."""
    return [{"id": c["id"], "type": "function",
             "function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}}
            for c in calls[:MAX_CALLS]]


InvalidReason = Literal["unknown_tool", "not_json", "schema_mismatch"]
"""Why a call is invalid, in the terms of the session contract's ``tool.call`` event."""


@dataclass(frozen=True)
class Invalid:
    reason: InvalidReason
    detail: str


def verdict(tools: Toolset | None, call: dict[str, Any]) -> Invalid | None:
    """Why ``call`` is invalid against the declared ``tools``, or None when it is valid.
    Spends the current :func:`schemas.budget`."""
    name, arguments = call["function"]["name"], call["function"]["arguments"]
    unknown = _unknown(tools, name)
    if unknown is not None:
        return Invalid("unknown_tool", unknown)
    assert tools is not None
    if len(arguments.encode("utf-8", "surrogatepass")) > MAX_ARGUMENT_BYTES:
        return Invalid("not_json", f"arguments longer than {MAX_ARGUMENT_BYTES} bytes")
    try:
        value = json.loads(arguments, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        return Invalid("not_json", f"arguments are not JSON: {str(exc)[:120]}")
    if not isinstance(value, dict):
        return Invalid("not_json", "arguments are not a JSON object")
    try:
        error = schemas.first_error(tools.validators[name], value)
    except schemas.BudgetExceededError as exc:
        error = f"not validated: {exc}"
    except RecursionError:
        error = "not validated: the schema recursed too deep"
    except Exception as exc:  # the schema cannot be applied to this value (an unresolvable $ref)
        error = f"not validated: {type(exc).__name__}: {str(exc)[:120]}"
    return None if error is None else Invalid("schema_mismatch", error)


def _unknown(tools: Toolset | None, name: str) -> str | None:
    """Why a call of ``name`` is not one the request allowed, or None."""
    if tools is None or not tools.validators:
        return "the request declared no tools"
    if tools.choice == "none":
        return "tool_choice was 'none'"
    if name not in tools.validators:
        return f"no tool named {name[:64]!r} was declared"
    if tools.choice is not None and tools.choice.startswith("function:") and name != tools.choice[9:]:
        return f"tool_choice named {tools.choice[9:]!r}, the model called {name[:64]!r}"
    return None


def judge(tools: Toolset | None, calls: list[dict[str, Any]]) -> list[Invalid | None]:
    """The verdict on each of an answer's calls (up to :data:`MAX_CALLS`), under one budget
    for the whole answer."""
    with schemas.budget(schemas.Budget()):
        return [verdict(tools, call) for call in calls[:MAX_CALLS]]


def count(tools: Toolset | None, calls: list[dict[str, Any]]) -> tuple[int, int]:
    """(tool calls, invalid ones) of one answer (the calls past :data:`MAX_CALLS` count as one
    invalid call)."""
    return tally(calls, judge(tools, calls))


def tally(calls: list[dict[str, Any]], verdicts: list[Invalid | None]) -> tuple[int, int]:
    """(tool calls, invalid ones) of one answer from its :func:`judge` verdicts."""
    if not calls:
        return 0, 0
    for call, bad in zip(calls, verdicts, strict=False):
        if bad is not None:
            log.debug("invalid tool call %r (%s): %s", call["function"]["name"][:64], bad.reason, bad.detail)
    return len(calls), sum(v is not None for v in verdicts) + int(len(calls) > MAX_CALLS)


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")
