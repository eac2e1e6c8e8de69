"""The session events the gateway logs beside a turn's ``completion.served`` (contract
revision 1.1, docs/events.md "Sessions"): one ``session.turn`` and one ``tool.call`` per
tool call of the answer, built from what the gateway saw. Pure functions, no I/O.

A request is a **session turn** when its client named the session (the body's
``session_id`` or the ``X-Rtrl-Session-Id`` header; the default, the user key, is not a
session) and its turn index is known: the body's ``turn`` or the ``X-Rtrl-Turn`` header,
else, for a chat request, the number of assistant messages in its history (turn 0 has
none). A client that replaces earlier turns with a self-summary shortens that history, so
it sends the turn index itself.

The gateway cannot see what happens after its answer: ``tool.result``, ``session.summary``
and ``session.end`` come from the client (docs/events.md).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from ingest.events import TURN_MAX
from services.gateway.chat.calls import MAX_CALLS, Invalid

TURN_HEADER = "X-Rtrl-Turn"
_ID = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")
_NAME_BAD = re.compile(r"[^A-Za-z0-9_.:\-]")
_DIGITS = re.compile(r"^[0-9]{1,7}$")


def turn_header(raw: str | None) -> int | None:
    """The ``X-Rtrl-Turn`` header's turn index, None when absent; ``ValueError`` with the
    reason when it is not a whole number in 0..TURN_MAX."""
    if raw is None:
        return None
    if not _DIGITS.fullmatch(raw) or int(raw) > TURN_MAX:
        raise ValueError(f"{TURN_HEADER} must be a whole number from 0 to {TURN_MAX}")
    return int(raw)


def turn_of(named_session: bool, body_turn: int | None, header: str | None,
            assistant_messages: int | None) -> int | None:
    """The request's turn index, or None when it is not a session turn: only a named session
    has turns; an explicit index (the body's, else the header's) wins; a chat request's
    history gives the rest. ``ValueError`` for a header that is not a turn index."""
    explicit = body_turn if body_turn is not None else turn_header(header)
    if not named_session:
        return None
    if explicit is not None:
        return explicit
    if assistant_messages is None or assistant_messages > TURN_MAX:
        return None
    return assistant_messages


def call_id(raw: str, request_id: str, index: int) -> str:
    """A tool call's id as the contract holds it: the engine's when it is a contract Id,
    else one made from the request id and the call's position (unique in the session)."""
    if _ID.fullmatch(raw):  # not match: "$" would let a trailing newline through
        return raw
    return f"{request_id[:116]}.call{index}"


def tool_name(raw: str) -> str:
    """A called tool's name within the contract's ``ToolName`` (a model may call any
    string): characters outside ``A-Za-z0-9_.:-`` become ``_``, at most 64 of them."""
    return _NAME_BAD.sub("_", raw)[:64] or "_"


def session_events(session_id: str, request_id: str, turn: int, ts: datetime,
                   calls: Sequence[dict[str, Any]],
                   verdicts: Sequence[Invalid | None]) -> list[dict[str, Any]]:
    """The ``session.turn`` of the turn, then a ``tool.call`` per call of its answer (up to
    :data:`MAX_CALLS`, with its verdict), as event fields. Every call is ``dispatched``: the
    gateway hands it to the client, which runs it or not (``tool.result`` says which)."""
    base = {"session_id": session_id, "request_id": request_id, "turn": turn, "ts": ts}
    out: list[dict[str, Any]] = [{"type": "session.turn", "event_id": uuid.uuid4().hex, **base}]
    for i, (call, bad) in enumerate(zip(calls[:MAX_CALLS], verdicts, strict=False)):
        fn = call["function"]
        out.append({
            "type": "tool.call", "event_id": uuid.uuid4().hex, **base,
            "call_id": call_id(call.get("id") or "", request_id, i), "tool": tool_name(fn["name"]),
            "arguments_valid": bad is None, "invalid_reason": None if bad is None else bad.reason,
            "arguments_chars": len(fn["arguments"]), "outcome": "dispatched",
        })
    return out
