"""The OpenAI API's shapes: request bodies in, response objects and stream chunks out.

Pure functions and pydantic models only (no I/O); services/gateway/openai_routes.py uses
them. What is honoured of each request is listed in docs/gateway.md ("OpenAI-compatible
API"); other OpenAI parameters are accepted and ignored, as the official client sends some
by default.
"""

from __future__ import annotations

import hashlib
import http
import json
import re
from collections.abc import AsyncGenerator, Callable, Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ingest.events import TURN_MAX
from services.gateway.chat.calls import MAX_CALLS, client_calls
from services.gateway.chat.declared import PastToolCall, Tool, ToolChoice, Toolset, toolset
from services.gateway.generation import GenRequest, Served

MAX_TOKENS_LIMIT = 4096
ID_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")
USER_HEADER = "X-Rtrl-User"
SESSION_HEADER = "X-Rtrl-Session-Id"
REQUEST_ID_HEADER = "X-Request-Id"


class Headers(Protocol):
    """Request headers, looked up case-insensitively (``email.message.Message`` or a dict)."""

    def get(self, name: str, default: None = None, /) -> str | None: ...


def _token(t: object) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    model: Annotated[str, Field(min_length=1, max_length=200)] | None = None
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=10.0, allow_inf_nan=False)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] = 1.0
    n: Literal[1] = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=8)] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    user: Annotated[str, Field(min_length=1, max_length=1024)] | None = None
    # rtrl's extensions (the official client sends them with extra_body=...)
    session_id: Annotated[str, Field(pattern=ID_RE.pattern)] | None = None
    request_id: Annotated[str, Field(pattern=ID_RE.pattern)] | None = None
    turn: Annotated[int, Field(ge=0, le=TURN_MAX, strict=True)] | None = None
    """The request's turn index in its (named) session: services/gateway/chat/turns.py."""

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionsBody(_Body):
    """``POST /v1/completions`` in the OpenAI form (text or token-id prompt)."""

    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[Any], Field(min_length=1, max_length=32_768)]
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: Literal[False] = False

    @field_validator("prompt", mode="after")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        """Text, token ids, or a batch of one of those (``["text"]``, ``[[1, 2]]``); larger batches
        and anything else are refused."""
        if isinstance(v, str):
            return v
        if len(v) == 1 and isinstance(v[0], str | list):
            v = v[0]
            if isinstance(v, str) and v:
                return v
        if isinstance(v, list) and v and all(_token(t) for t in v):
            return v
        raise ValueError("one prompt per request: a non-empty string or a list of token ids in [0, 2^31)")

    def to_request(self, default_max_tokens: int) -> GenRequest:
        prompt = self.prompt if isinstance(self.prompt, str) else tuple(self.prompt)
        return GenRequest("completion", self.max_tokens or default_max_tokens, self.temperature,
                          prompt=prompt, top_p=self.top_p, stop=self.stops(), seed=self.seed,
                          logprobs=self.logprobs)


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: Annotated[list[PastToolCall], Field(max_length=MAX_CALLS)] | None = None
    """An assistant turn's tool calls, sent back in the history."""
    tool_call_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    """A ``tool`` message: the call it answers."""

    @model_validator(mode="after")
    def _tool_fields(self) -> Message:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def wire(self) -> dict[str, Any]:
        """The message as the engine gets it: text content, and the tool-call fields it has."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
            if self.content is None:
                out["content"] = None
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatBody(_Body):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[Message], Field(min_length=1, max_length=1024)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def assistant_turns(self) -> int:
        """The assistant messages in the history: the turns of the session before this one."""
        return sum(m.role == "assistant" for m in self.messages)

    def toolset(self) -> Toolset | None:
        """The request's checked tools (raises ``ValueError``: services/gateway/chat/declared.py)."""
        return toolset(self.tools, self.tool_choice)

    def to_request(self, default_max_tokens: int) -> GenRequest:
        try:
            messages = tuple(m.wire() for m in self.messages)
        except ValueError as exc:
            raise ValueError(f"messages: {exc}") from None
        max_tokens = self.max_completion_tokens or self.max_tokens or default_max_tokens
        picked = self.tool_choice
        choice = picked.model_dump() if isinstance(picked, BaseModel) else picked
        return GenRequest("chat", max_tokens, self.temperature, messages=messages, top_p=self.top_p,
                          stop=self.stops(), seed=self.seed,
                          logprobs=(self.top_logprobs or 0) if self.logprobs else None,
                          tools=tuple(t.model_dump(exclude_none=True) for t in self.tools or ()),
                          tool_choice=choice, parallel_tool_calls=self.parallel_tool_calls)


def validation_error(exc: ValidationError) -> str:
    errors = exc.errors(include_url=False)
    if any(e["type"] == "json_invalid" for e in errors):
        return "malformed JSON: " + str(errors[0].get("ctx", {}).get("error", errors[0]["msg"]))
    parts = [f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in errors[:5]]
    return "invalid request: " + "; ".join(parts)


def user_key(body_user: str | None, headers: Headers) -> str | None:
    """The sticky-routing key: the body's ``user``, else the ``X-Rtrl-User`` header. A value
    that is not a contract Id (``A-Za-z0-9_.:-``, 1-128 chars; e.g. an e-mail address) is
    pseudonymised as ``h-`` + 32 hex chars of its SHA-256, so it never reaches the event log."""
    raw = body_user if body_user is not None else headers.get(USER_HEADER)
    if raw is None or raw == "":
        return None
    if ID_RE.match(raw):
        return raw
    return "h-" + hashlib.sha256(raw.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def usage(served: Served) -> dict[str, int]:
    p, c = len(served.prompt_tokens), len(served.tokens)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def merge_logprobs(kind: str, parts: list[Any]) -> Any:
    """The client's logprobs object for the whole answer, from the per-piece ones."""
    if not parts:
        return None
    if kind == "chat":
        return {"content": [c for p in parts for c in (p.get("content") or [])]}
    merged: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for p in parts:
        for key, values in merged.items():
            values.extend(p.get(key) or [])
    if not merged["top_logprobs"]:
        merged["top_logprobs"] = None  # type: ignore[assignment]
    return merged


def answer(kind: str, rid: str, model: str, created: int, served: Served,
           extension: dict[str, Any]) -> dict[str, Any]:
    """The whole (non-streamed) response object."""
    logprobs = merge_logprobs(kind, served.client_logprobs)
    finish = served.finish_reason or "length"
    choice: dict[str, Any]
    if kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": served.text}
        if served.tool_calls:
            message.update(content=served.text or None, tool_calls=client_calls(served.tool_calls))
        if served.refusal:
            message["refusal"] = served.refusal
        choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": served.text, "logprobs": logprobs, "finish_reason": finish}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice],
            "usage": usage(served), "rtrl": extension}


def chunk(kind: str, rid: str, model: str, created: int, text: str, logprobs: Any,
          finish_reason: str | None, first: bool = False,
          tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One streamed chunk (``chat.completion.chunk`` or ``text_completion``); ``tool_calls``:
    a chat chunk's tool-call deltas (services/gateway/chat/calls.py)."""
    if kind == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
        if finish_reason is not None and not text:
            delta = {}
        relayed = [c for c in tool_calls or () if c["index"] < MAX_CALLS]
        if relayed:
            delta["tool_calls"] = relayed
            if not text:
                delta["content"] = None
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": logprobs,
                                  "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}


def usage_chunk(kind: str, rid: str, model: str, created: int, served: Served) -> dict[str, Any]:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(served)}


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event: ``data: <json>`` and a blank line."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return b"data: " + text.encode() + b"\n\n"


def models_list(names: list[str], created: int) -> dict[str, Any]:
    return {"object": "list", "data": [
        {"id": name, "object": "model", "created": created, "owned_by": "rtrl"} for name in names
    ]}


# --------------------------------------------------------------------- responses and errors
# Every error, from the API, the HTTP application or the connection guard
# (services/gateway/asgi/), is OpenAI's error object, so the official ``openai`` client raises
# its matching exception (``BadRequestError``, ``RateLimitError``, ...) and clients can
# branch on ``type`` and ``code``.


@dataclass(frozen=True)
class Response:
    code: int
    body: bytes
    content_type: str = "application/json"
    headers: tuple[tuple[str, str], ...] = ()
    stream: Iterator[bytes] | None = None
    """When set, the body is sent as these chunks (``Transfer-Encoding: chunked``), each
    written as soon as it is produced; ``body`` is ignored."""
    astream: AsyncGenerator[bytes, None] | None = None
    """The same, produced on the event loop (a relayed engine stream)."""
    after: Callable[[], object] | None = None
    """Bookkeeping that need not delay the answer (metrics, the judge's served counts): the
    server runs it once the answer is written. The exposure is never in it: it is spooled
    before the answer exists."""


ERROR_CODES: dict[int, str] = {
    401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed", 408: "request_timeout",
    409: "conflict", 413: "request_too_large", 414: "request_line_too_long",
    415: "unsupported_media_type", 429: "rate_limit_exceeded", 431: "headers_too_large",
    501: "method_not_supported", 503: "unavailable", 504: "upstream_timeout",
    505: "http_version_not_supported",
}
"""The ``code`` of an error whose caller names none, by HTTP status (400 and 500: none)."""


def error_type(status: int) -> str:
    """OpenAI's ``type``: what the client did wrong, or the server's fault."""
    if status == 401:
        return "authentication_error"
    if status == 429:
        return "rate_limit_exceeded"
    return "server_error" if status >= 500 else "invalid_request_error"


def error_body(message: str, code: str | None = None, param: str | None = None,
               kind: str = "invalid_request_error") -> dict[str, Any]:
    """OpenAI's error object, which the official client parses into its exceptions."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def json_response(code: int, body: dict[str, Any], headers: tuple[tuple[str, str], ...] = ()) -> Response:
    return Response(code, json.dumps(body, separators=(",", ":")).encode(), headers=headers)


def error_response(status: int, message: str, code: str | None = None, kind: str | None = None,
                   headers: tuple[tuple[str, str], ...] = ()) -> Response:
    """An error answer: ``code`` defaults by status (:data:`ERROR_CODES`), ``kind`` (the
    object's ``type``) by :func:`error_type`."""
    body = error_body(message, code or ERROR_CODES.get(status), kind=kind or error_type(status))
    return json_response(status, body, headers)


def error_bytes(status: int, message: str, code: str | None = None,
                headers: tuple[tuple[str, str], ...] = ()) -> bytes:
    """A whole HTTP/1.1 error answer that closes the connection, for the connection guard,
    which answers before any request reaches the application."""
    resp = error_response(status, message, code)
    phrase = http.HTTPStatus(status).phrase
    lines = [f"HTTP/1.1 {status} {phrase}", "content-type: application/json",
             f"content-length: {len(resp.body)}", "connection: close",
             *(f"{name}: {value}" for name, value in headers)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + resp.body
