"""The ``vllm`` serving backend: one model name on an OpenAI-compatible engine.

Each model version the gateway serves is a model name on the engine: the base model, or a
LoRA adapter the deployer loaded (``/v1/load_lora_adapter``) before routing any traffic to
it. The gateway forwards each request to ``/v1/completions`` or ``/v1/chat/completions``
with vLLM's ``return_token_ids: true`` and ``logprobs``, so every answer carries the exact
prompt and completion token ids and the per-token log-probabilities as the engine served
them; the exposure event is built from those, never from re-tokenized text. Streamed
requests are relayed chunk by chunk.

The engine must be vLLM (or a server with the same extensions): see docs/serving.md.
"""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import AsyncGenerator, Iterator, Sequence
from typing import Any, Literal, Protocol
from urllib.parse import urlsplit

from services.gateway.chat import calls
from services.gateway.generation import GenRequest, Piece, UpstreamError, clean_logprob
from services.gateway.models import Generation


class Relay(Protocol):
    """An asynchronous client of the engine (services/gateway/asgi/relay.AsyncEngineClient)."""

    def pieces(self, model: str, req: GenRequest, stream: bool = True) -> AsyncGenerator[Piece, None]: ...

    def close(self) -> None: ...


def _ids(value: Any) -> list[int] | None:
    if not isinstance(value, list):
        return None
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in value):
        raise UpstreamError(502, "engine returned token ids that are not integers in [0, 2^31)")
    return list(value)


def sampled_logprobs(kind: str, logprobs: Any) -> list[float]:
    """The sampled tokens' log-probabilities from an OpenAI logprobs object."""
    if not isinstance(logprobs, dict):
        return []
    if kind == "chat":
        content = logprobs.get("content") or []
        return [clean_logprob(c.get("logprob") if isinstance(c, dict) else None) for c in content]
    return [clean_logprob(x) for x in (logprobs.get("token_logprobs") or [])]


def parse_choice(kind: str, data: Any) -> Piece:
    """One response or stream chunk of the engine -> a :class:`Piece`."""
    try:
        choice = data["choices"][0]
    except (KeyError, IndexError, TypeError):
        raise UpstreamError(502, "engine response has no choices") from None
    if not isinstance(choice, dict):
        raise UpstreamError(502, "engine response choice is not an object")
    holder: Any = {}
    if kind == "chat":
        holder = choice.get("message") or choice.get("delta") or {}
        holder = holder if isinstance(holder, dict) else {}
        text = holder.get("content")
    else:
        text = choice.get("text")
    tokens = _ids(choice.get("token_ids")) or []
    prompt = _ids(choice.get("prompt_token_ids")) or _ids(data.get("prompt_token_ids"))
    logprobs = sampled_logprobs(kind, choice.get("logprobs"))
    refusal = holder.get("refusal")
    return Piece(text=text if isinstance(text, str) else "", tokens=tokens, logprobs=logprobs,
                 finish_reason=choice.get("finish_reason"), prompt_tokens=prompt,
                 client_logprobs=choice.get("logprobs"), tool_calls=calls.deltas(holder.get("tool_calls")),
                 refusal=refusal if isinstance(refusal, str) else None)


def engine_body(req: GenRequest, model: str, stream: bool) -> dict[str, Any]:
    """The request sent to the engine for ``req``."""
    body: dict[str, Any] = {
        "model": model, "max_tokens": req.max_tokens, "temperature": req.temperature,
        "top_p": req.top_p, "return_token_ids": True, "stream": stream,
    }
    if req.stop:
        body["stop"] = list(req.stop)
    if req.seed is not None:
        body["seed"] = req.seed
    if req.kind == "chat":
        body.update(messages=list(req.messages), logprobs=True, top_logprobs=req.logprobs or 0)
        if req.tools:  # tool_choice and parallel_tool_calls mean nothing without tools
            body["tools"] = list(req.tools)
            if req.tool_choice is not None:
                body["tool_choice"] = req.tool_choice
            if req.parallel_tool_calls is not None:
                body["parallel_tool_calls"] = req.parallel_tool_calls
    else:
        prompt = req.prompt if isinstance(req.prompt, str) else list(req.prompt or ())
        body.update(prompt=prompt, logprobs=max(1, req.logprobs or 0))
    return body


class EngineClient:
    """HTTP/1.1 to one engine over persistent connections (one per calling thread)."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 60.0,
                 name: str = "engine") -> None:
        self.name = name
        """What error messages call the server (``engine``, ``upstream``)."""
        parts = urlsplit(base_url)
        if parts.scheme not in {"http", "https"} or not parts.hostname:
            raise ValueError(f"{name} base_url {base_url!r} must be http(s)://host[:port][/path]")
        self._https = parts.scheme == "https"
        self._host, self._port = parts.hostname, parts.port
        self.prefix = parts.path.rstrip("/")
        self.timeout_s = timeout_s
        self._local = threading.local()
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def _conn(self, fresh: bool) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is None or fresh:
            if conn is not None:
                conn.close()
            cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            conn = cls(self._host, self._port, timeout=self.timeout_s)
            self._local.conn = conn
        return conn

    def open(self, method: str, path: str, body: dict[str, Any] | None = None) -> http.client.HTTPResponse:
        """Send a request; the response's body is left to the caller (read it all, or close)."""
        payload = json.dumps(body).encode() if body is not None else None
        for attempt in (0, 1):
            conn = self._conn(fresh=attempt > 0)
            try:
                conn.request(method, self.prefix + path, body=payload, headers=self.headers)
                return conn.getresponse()
            except TimeoutError:
                conn.close()
                raise UpstreamError(504, f"{self.name} did not answer within {self.timeout_s:g}s") from None
            except (http.client.HTTPException, OSError) as exc:
                conn.close()  # a kept-alive connection the server closed: retry once
                if attempt == 1:
                    raise UpstreamError(502, f"{self.name} unreachable: {exc}") from None
        raise AssertionError("unreachable")

    def exchange(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, bytes]:
        """A whole exchange: (status, the response body)."""
        resp = self.open(method, path, body)
        try:
            return resp.status, resp.read()
        except (TimeoutError, OSError, http.client.HTTPException) as exc:
            self._drop()
            code = 504 if isinstance(exc, TimeoutError) else 502
            raise UpstreamError(code, f"{self.name} read failed: {exc}") from None

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        """A whole JSON exchange: (status, parsed body or the raw text when not JSON)."""
        status, raw = self.exchange(method, path, body)
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw[:300].decode("utf-8", "replace")

    def finish(self, resp: http.client.HTTPResponse, drain_s: float = 2.0, limit: int = 65536) -> None:
        """Read what is left of a response (a stream's closing chunk after ``[DONE]``) so its
        connection can carry the next request; one whose rest is not read within ``drain_s``
        per read, or is longer than ``limit`` bytes, is closed instead. Left unread, the next
        request would go out on it, ``http.client`` would refuse its answer
        (``ResponseNotReady``) and :meth:`open` would send it again on a new connection: the
        engine would run that request twice."""
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        sock = conn.sock if conn is not None else None
        try:
            if sock is not None:
                sock.settimeout(drain_s)
            resp.read(limit)
            if not resp.isclosed():  # more than ``limit`` after the end: not an engine we know
                self._drop()
            elif sock is not None:
                sock.settimeout(self.timeout_s)
        except (TimeoutError, OSError, http.client.HTTPException):
            self._drop()

    def _drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    def close(self) -> None:
        self._drop()


def sse_event(kind: str, line: bytes) -> Piece | Literal["done"] | None:
    """One line of an engine's server-sent events: its piece, ``"done"`` at ``[DONE]``, None
    for a line that carries no piece (comments, blank lines, events without choices). An
    error event raises :class:`UpstreamError`; a malformed one ``ValueError``."""
    text = line.strip()
    if not text.startswith(b"data:"):
        return None
    payload = text[5:].strip()
    if payload == b"[DONE]":
        return "done"
    data = json.loads(payload)
    if isinstance(data, dict) and data.get("choices"):
        return parse_choice(kind, data)
    if isinstance(data, dict) and "error" in data:
        raise engine_error(502, data)
    return None


def error_answer(status: int, raw: bytes) -> UpstreamError:
    """An engine's error answer, JSON or not, as the gateway's (:func:`engine_error`)."""
    try:
        return engine_error(status, json.loads(raw))
    except ValueError:
        return engine_error(status, raw[:300].decode("utf-8", "replace"))


def engine_error(status: int, body: Any) -> UpstreamError:
    """An engine's error answer -> the gateway's: the client's mistakes (400, 404 for a
    model, 413, 422) pass through as 400; anything else is 502."""
    message = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(message, dict):
        message = message.get("message", message)
    text = str(message)[:300]
    code = 400 if status in {400, 413, 422} else 502
    return UpstreamError(code, f"engine answered {status}: {text}")


class EngineBackend:
    """One model name on the engine, served through :class:`EngineClient` (blocking, for the
    token-id API and callers without an event loop) and, given ``relay``, through an
    :class:`Relay` on the server's event loop."""

    vocab_size: int | None = None

    def __init__(self, client: EngineClient, model: str, relay: Relay | None = None) -> None:
        self.client = client
        self.model = model
        self.relay = relay
        self.relays = relay is not None
        """True: :meth:`astream` serves without a thread (the gateway's event-loop path)."""

    def astream(self, req: GenRequest, stream: bool = True) -> AsyncGenerator[Piece, None]:
        if self.relay is None:
            raise RuntimeError("this engine backend has no asynchronous relay")
        return self.relay.pieces(self.model, req, stream)

    def stream(self, req: GenRequest, stream: bool = True) -> Iterator[Piece]:
        path = "/v1/chat/completions" if req.kind == "chat" else "/v1/completions"
        if not stream:
            status, data = self.client.call("POST", path, engine_body(req, self.model, False))
            if status != 200:
                raise engine_error(status, data)
            yield parse_choice(req.kind, data)
            return
        resp = self.client.open("POST", path, engine_body(req, self.model, True))
        if resp.status != 200:
            raise error_answer(resp.status, resp.read())
        yield from self._events(req.kind, resp)

    def _events(self, kind: str, resp: http.client.HTTPResponse) -> Iterator[Piece]:
        done = False
        try:
            while line := resp.readline():
                event = sse_event(kind, line)
                if isinstance(event, Piece):
                    yield event
                elif event == "done":
                    done = True
                    break
        except (TimeoutError, OSError, http.client.HTTPException, ValueError) as exc:
            raise UpstreamError(502, f"engine stream broke: {exc}") from None
        finally:
            if done:
                self.client.finish(resp)
            else:
                self.client.close()  # a half-read stream cannot be reused
        if not done:
            raise UpstreamError(502, "engine stream ended without [DONE]")

    def generate(self, prompt_tokens: Sequence[int], max_tokens: int, temperature: float) -> Generation:
        """The token-id API: one non-streamed completion of a token-id prompt."""
        req = GenRequest("completion", max_tokens, temperature, prompt=tuple(prompt_tokens))
        [piece] = list(self.stream(req, stream=False))
        if len(piece.tokens) != len(piece.logprobs):
            raise UpstreamError(502, f"engine returned {len(piece.tokens)} token ids but "
                                     f"{len(piece.logprobs)} logprobs; is return_token_ids supported?")
        return Generation(tokens=piece.tokens, logprobs=piece.logprobs)

    def close(self) -> None:
        return None  # the client is shared by every version on the engine
