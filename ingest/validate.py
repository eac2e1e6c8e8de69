"""Validation of one raw record: bytes in, ``Accepted(event)`` or ``Rejected(reason)`` out.

``validate`` is pure and never raises on input. Checks run cheapest first and the first
failure decides the reason:

1. ``oversized``               value longer than ``Limits.max_bytes`` (before any parsing)
2. ``unsigned`` / ``unknown_key`` / ``bad_signature``   producer authentication (ingest/auth.py)
3. ``not_utf8`` / ``bad_json`` / ``not_object``          the bytes are not a JSON object
4. ``unknown_schema_version`` / ``unknown_type`` / ``missing_field`` / ``invalid_field``
                               the object does not match the event contract (ingest/events.py)
   ``duplicate_key``           an object of the event names one key twice (JSON parsers
                               disagree on which value wins, so the record is ambiguous)
5. ``ts_future`` / ``ts_too_old``   ``ts`` outside [now - max_age_s, now + max_future_skew_s]
6. ``key_mismatch``            the Kafka key is set and differs from ``request_id``

``duplicate`` is decided later, by the dedup store (ingest/dedup.py). The reason codes
are stable strings: they label the ``rtrl_ingest_rejected_total`` metric and the DLQ
records, and docs/ingest.md lists them.

A rejection's ``detail`` never echoes payload content: it is made of fixed text, contract
field names (any other key is shown as ``<unknown field>``), list indexes and numbers the
check computed (sizes, offsets, seconds), at most ``DETAIL_MAX`` characters.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from ingest.auth import AuthPolicy, Headers, authenticate
from ingest.events import (
    EVENT_TYPES,
    SCHEMA_VERSION,
    CompletionServed,
    EditAccepted,
    EditPersistence,
    EditRejected,
    Event,
    FollowupDissatisfied,
    ModelRef,
    SessionEnd,
    SessionSummary,
    SessionTurn,
    ToolCall,
    ToolResult,
    parse_event,
)

REASONS = (
    "oversized", "not_utf8", "bad_json", "not_object", "unknown_schema_version", "unknown_type",
    "missing_field", "invalid_field", "duplicate_key", "ts_future", "ts_too_old", "unsigned", "bad_signature",
    "unknown_key", "key_mismatch", "duplicate",
)
"""Every reason code a rejection can carry, in documentation order."""

DETAIL_MAX = 300
"""Longest ``Rejected.detail`` (characters)."""


@dataclass(frozen=True)
class Limits:
    max_bytes: int = 256 * 1024
    max_future_skew_s: float = 300.0
    max_age_s: float = 7 * 86_400.0


@dataclass(frozen=True)
class Accepted:
    event: Event


@dataclass(frozen=True)
class Rejected:
    reason: str
    """One of ``REASONS``."""
    detail: str
    """Human-readable: which check failed and why (never the payload itself)."""


Outcome = Accepted | Rejected


def validate(
    value: bytes | None,
    headers: Headers,
    key: bytes | None,
    now: datetime,
    limits: Limits,
    auth: AuthPolicy,
) -> Outcome:
    """Validate one raw record. ``now`` is the ingest clock (timezone-aware)."""
    data = value if value is not None else b""
    if len(data) > limits.max_bytes:
        return Rejected("oversized", f"{len(data)} bytes > limit {limits.max_bytes}")
    failure = authenticate(data, headers, auth)
    if failure is not None:
        return Rejected(failure.reason, failure.detail)
    try:
        event = parse_event(data)
    except ValidationError as exc:
        return classify_errors(data, exc)
    except Exception as exc:  # the parser must never take the worker down
        return Rejected("bad_json", f"parser error ({type(exc).__name__})")
    repeated = duplicate_key(data)
    if repeated is not None:
        return Rejected("duplicate_key", f"an object names the key {_field(repeated)} more than once")
    return _check_event(event, key, now, limits)


def _check_event(event: Event, key: bytes | None, now: datetime, limits: Limits) -> Outcome:
    ahead = (event.ts - now).total_seconds()
    if ahead > limits.max_future_skew_s:
        return Rejected("ts_future", f"ts is {ahead:.0f}s ahead of ingest time "
                                     f"(limit {limits.max_future_skew_s:.0f}s)")
    if -ahead > limits.max_age_s:
        return Rejected("ts_too_old", f"ts is {-ahead:.0f}s old (limit {limits.max_age_s:.0f}s)")
    if key is not None and key != event.request_id.encode():
        return Rejected("key_mismatch", f"the Kafka key ({len(key)} bytes) is not the event's request_id "
                                        "(neither echoed)")
    return Accepted(event)


def classify_errors(data: bytes, exc: ValidationError) -> Rejected:
    """Map pydantic's errors for a failed parse to one stable reason code."""
    errors = exc.errors(include_url=False, include_input=False, include_context=False)
    types = {e["type"] for e in errors}
    if "json_invalid" in types:
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as ue:
            return Rejected("not_utf8", f"invalid UTF-8 at byte {ue.start}")
        return Rejected("bad_json", _join(errors))
    if any(e["type"] in ("dict_type", "model_type", "model_attributes_type") and not e["loc"]
           for e in errors):
        return Rejected("not_object", "the value must be a JSON object")
    version = _schema_version(data)
    if version is not _ABSENT and (isinstance(version, bool) or version != SCHEMA_VERSION):
        return Rejected("unknown_schema_version", _version_problem(version))
    if "union_tag_not_found" in types:
        return Rejected("missing_field", "type: field required")
    if "union_tag_invalid" in types:
        return Rejected("unknown_type", f"type: must be one of {', '.join(EVENT_TYPES)}")
    missing = [e for e in errors if e["type"] == "missing"]
    if missing:
        return Rejected("missing_field", _join(missing))
    return Rejected("invalid_field", _join(errors))


_ABSENT: Any = object()


_JSON_TYPES = {bool: "a boolean", str: "a string", float: "a fraction", list: "an array", dict: "an object",
               type(None): "null"}


def _version_problem(version: Any) -> str:
    """Why a ``schema_version`` is not accepted: its JSON type, or an unknown version number."""
    if isinstance(version, int) and not isinstance(version, bool):
        return f"schema_version is an integer other than {SCHEMA_VERSION}, the only supported version"
    kind = _JSON_TYPES.get(type(version), "not a number")
    return f"schema_version must be the integer {SCHEMA_VERSION}, not {kind}"


class _RepeatedKeyError(Exception):
    pass


def _no_repeats(pairs: list[tuple[str, Any]]) -> None:
    if len(pairs) > 1 and len({k for k, _ in pairs}) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise _RepeatedKeyError(k)
            seen.add(k)


_KEY_BYTES = re.compile(rb'"([^"]*)"\s*:')
_KEY_STR = re.compile(r'"([^"]*)"\s*:')


def _keys_all_distinct(data: bytes | str) -> bool:
    """Whether no key name occurs twice anywhere in the JSON document ``data``, when that can
    be read off its text; False when it cannot, or when some name does repeat.

    Exact for valid JSON without a backslash: no string holds a quote then, so every match of
    ``"...":`` starts at a key's opening quote and every key matches once. A name used in two
    different objects also reads as repeated: the caller then checks object by object."""
    if isinstance(data, bytes):
        if b"\\" in data:
            return False
        keys: list[Any] = _KEY_BYTES.findall(data)
    else:
        if "\\" in data:
            return False
        keys = _KEY_STR.findall(data)
    return len(set(keys)) == len(keys)


def duplicate_key(data: bytes | str) -> str | None:
    """The first key that an object of the JSON document ``data`` names twice (None: no
    object repeats a key, or ``data`` is not JSON this parser reads).

    Most events have no key name twice at all, which a scan of the text shows (about a fifth
    of an ingest worker's CPU went to parsing every event a second time for this check); the
    others are parsed object by object."""
    if _keys_all_distinct(data):
        return None
    try:
        json.loads(data, object_pairs_hook=_no_repeats)
    except _RepeatedKeyError as rep:
        return str(rep.args[0])
    except (ValueError, RecursionError):
        return None
    return None


_FIELDS = frozenset(name for model in (CompletionServed, EditAccepted, EditRejected, EditPersistence,
                                       FollowupDissatisfied, ModelRef, SessionTurn, ToolCall, ToolResult,
                                       SessionSummary, SessionEnd) for name in model.model_fields)
"""Every field name of the contract: the only keys a detail may name."""


def _field(name: object) -> str:
    """A location element as it may appear in a detail: contract field names and indexes only."""
    if isinstance(name, int):
        return str(name)
    return name if isinstance(name, str) and name in _FIELDS else "<unknown field>"


def _schema_version(data: bytes) -> Any:
    """The raw ``schema_version`` of a JSON object, or ``_ABSENT``. Only on the error path."""
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError):
        return _ABSENT
    if not isinstance(obj, dict):
        return _ABSENT
    return obj.get("schema_version", _ABSENT)


def _join(errors: Sequence[Any]) -> str:
    """``field.path: message; ...`` without the union tag prefix pydantic adds to locations."""
    parts = []
    for e in errors[:3]:
        loc = e["loc"]
        if loc and isinstance(loc[0], str) and "." in loc[0]:  # the union tag, e.g. 'edit.accepted'
            loc = loc[1:]
        where = ".".join(_field(p) for p in loc) or "value"
        parts.append(f"{where}: {e['msg']}")
    if len(errors) > 3:
        parts.append(f"(+{len(errors) - 3} more)")
    return "; ".join(parts)[:DETAIL_MAX]
