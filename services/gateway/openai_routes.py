"""The OpenAI-compatible routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (text
or token-id ``prompt``) and ``GET /v1/models``, streamed (server-sent events) or not.

Per request: validate -> the user key (``user`` or ``X-Rtrl-User``) -> claim the request id
-> pick the arm -> generate (a canary that fails before its first token is retried on
stable) -> answer -> log one exposure with the prompt and completion token ids and the
log-probabilities as the backend served them. rtrl's extras travel in headers
(``X-Rtrl-Request-Id``, ``X-Rtrl-Arm``, ``X-Rtrl-Model-Version``) and in an ``rtrl`` field
of the response object, which the official ``openai`` client keeps as an extra attribute.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from pydantic import ValidationError

from deployer.routing import Arm
from ingest.contracts.prometheus import GATEWAY_ERRORS, GATEWAY_FALLBACKS, GATEWAY_REQUESTS, GATEWAY_SECONDS
from services.gateway import openai_api as api
from services.gateway.chat import calls, turns
from services.gateway.chat.classify import answer_fields
from services.gateway.chat.declared import Toolset
from services.gateway.exposure import ALSO
from services.gateway.generation import BadRequestError, GenRequest, Piece, Served, UpstreamError
from services.gateway.models import Backend
from services.gateway.openai_api import Response, error_response, json_response
from services.gateway.request_ids import RequestIds
from services.settings.services import GatewaySettings


class Gateway(Protocol):
    """What the routes use of the gateway (``services/gateway/server.Gateway``)."""

    settings: GatewaySettings
    model_name: str
    request_ids: RequestIds
    count: Callable[..., object]
    """``count(version, arm, error, user)``: the judge's per-arm request and error counts."""
    log_exposure: Callable[[dict[str, Any]], object]

    def pick(self, user_key: str) -> tuple[Arm, str, Backend, tuple[str, Backend]] | Response: ...

log = logging.getLogger(__name__)


def oai_error(code: int, message: str, kind: str | None = None, err: str | None = None,
              arm: str = "none", version: str = "none") -> Response:
    GATEWAY_REQUESTS.labels(arm, version, str(code)).inc()
    return error_response(code, message, err, kind)


@dataclass
class Call:
    """One validated request on its way through the gateway."""

    kind: str
    req: GenRequest
    body: api.CompletionsBody | api.ChatBody
    user_key: str
    session_id: str
    request_id: str
    claimed: bool
    started: float
    arm: Arm = "stable"
    version: str = ""
    tools: Toolset | None = None
    """Chat: the declared tools the answer's tool calls are validated against."""
    turn: int | None = None
    """The turn index in a session the client named; None: not a session turn."""


class OpenAIRoutes:
    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway

    # ----------------------------------------------------------------- entry points
    def models(self) -> Response:
        return json_response(200, api.models_list([self.gw.model_name], int(time.time())))

    def complete(self, kind: str, data: Any, headers: api.Headers) -> Response:
        call = self._call(kind, data, headers)
        if isinstance(call, Response):
            return call
        if call.claimed and not self.gw.request_ids.claim(call.request_id):
            return _duplicate(call)
        response = self._serve(call)
        if response.code != 200 and call.claimed:
            self.gw.request_ids.release(call.request_id)
        return response

    async def acomplete(self, kind: str, data: Any, headers: api.Headers) -> Response:
        """:meth:`complete` on the event loop, for backends that relay asynchronously (a Redis
        round trip for a client's request id goes to a thread). A streamed answer's body is an
        async iterator. Cancelled (the client left), it stops the engine's generation."""
        call = self._call(kind, data, headers)
        if isinstance(call, Response):
            return call
        ids = self.gw.request_ids
        if call.claimed and not await _off_loop(ids.remote, ids.claim, call.request_id):
            return _duplicate(call)
        response: Response | None = None
        try:
            response = await self._aserve(call)
        finally:
            if call.claimed and (response is None or response.code != 200):
                await _off_loop(ids.remote, ids.release, call.request_id)
        return response

    # ----------------------------------------------------------------- validation
    def _call(self, kind: str, data: Any, headers: api.Headers) -> Call | Response:
        model = api.ChatBody if kind == "chat" else api.CompletionsBody
        try:
            body = model.model_validate(data)
            req = body.to_request(self.gw.settings.default_max_tokens)
            tools = body.toolset() if isinstance(body, api.ChatBody) else None
        except ValidationError as exc:
            return oai_error(400, api.validation_error(exc))
        except ValueError as exc:
            return oai_error(400, f"invalid request: {exc}")
        if body.model is not None and body.model != self.gw.model_name:
            return oai_error(404, f"the model {body.model!r} does not exist; this gateway serves "
                                  f"{self.gw.model_name!r} (GET /v1/models)", err="model_not_found")
        user = api.user_key(body.user, headers)
        if user is None:
            return oai_error(400, "no user: set the request's `user` field or the X-Rtrl-User header "
                                  "(the key that keeps a user on one arm)", err="user_required")
        named = body.session_id or headers.get(api.SESSION_HEADER) or None  # an empty header names none
        session = named or user
        rid = body.request_id or headers.get(api.REQUEST_ID_HEADER)
        if not api.ID_RE.match(session) or (rid is not None and not api.ID_RE.match(rid)):
            return oai_error(400, "session and request ids must be 1-128 chars of A-Za-z0-9_.:-")
        history = body.assistant_turns() if isinstance(body, api.ChatBody) else None
        try:
            turn = turns.turn_of(named is not None, body.turn, headers.get(turns.TURN_HEADER), history)
        except ValueError as exc:
            return oai_error(400, str(exc))
        return Call(kind, req, body, user, session, rid or uuid.uuid4().hex, rid is not None,
                    time.perf_counter(), tools=tools, turn=turn)

    # ----------------------------------------------------------------- generation
    def _serve(self, call: Call) -> Response:
        picked = self.gw.pick(call.user_key)
        if isinstance(picked, Response):
            return picked
        arm, version, backend, stable = picked
        first = self._start(call, arm, version, backend, stable)
        if isinstance(first, Response):
            return first
        pieces, head = first
        if call.body.stream:
            return Response(200, b"", "text/event-stream", self._headers(call), self._sse(call, pieces, head))
        served = Served()
        served.add(head)
        try:
            for piece in pieces:
                served.add(piece)
        except Exception as exc:
            return self._failed(call, exc)
        return self._whole(call, served)

    async def _aserve(self, call: Call) -> Response:
        picked = self.gw.pick(call.user_key)
        if isinstance(picked, Response):
            return picked
        arm, version, backend, stable = picked
        first = await self._astart(call, arm, version, backend, stable)
        if isinstance(first, Response):
            return first
        pieces, head = first
        if call.body.stream:
            events = self._asse(call, pieces, head)
            return Response(200, b"", "text/event-stream", self._headers(call), astream=events)
        served = Served()
        served.add(head)
        try:
            async with contextlib.aclosing(pieces):
                async for piece in pieces:
                    served.add(piece)
        except Exception as exc:
            return self._failed(call, exc)
        return self._whole(call, served)

    def _whole(self, call: Call, served: Served) -> Response:
        """The answer to a non-streamed request, once all of it was generated."""
        if call.req.logprobs is None:
            served.client_logprobs = []  # the backend's, needed for the event, not asked for
        problem = served.problem()
        if problem is not None:
            GATEWAY_ERRORS.labels(call.arm, call.version, "upstream").inc()
            return oai_error(502, f"cannot log this completion: {problem}", "server_error", arm=call.arm,
                             version=call.version)
        latency_ms, gen_s = self._expose(call, served)
        extension = {"request_id": call.request_id, "arm": call.arm, "version": call.version,
                     "latency_ms": latency_ms}
        created = int(time.time())
        obj = api.answer(call.kind, call.request_id, self.gw.model_name, created, served, extension)
        return Response(200, json_response(200, obj).body, headers=self._headers(call),
                        after=functools.partial(self._tally, call, gen_s))

    def _start(self, call: Call, arm: Arm, version: str, backend: Backend,
               stable: tuple[str, Backend]) -> tuple[Iterator[Piece], Piece] | Response:
        """The backend's iterator and its first piece; a canary failing here falls back to stable."""
        for attempt in (arm, "stable"):
            call.arm, call.version = attempt, version
            try:
                pieces = backend.stream(call.req, stream=call.body.stream)
                return pieces, next(pieces)
            except Exception as exc:
                refused = self._start_failed(call, exc)
                if refused is not None:
                    return refused
                version, backend = stable
        raise AssertionError("unreachable")

    async def _astart(self, call: Call, arm: Arm, version: str, backend: Backend,
                      stable: tuple[str, Backend]) -> tuple[AsyncGenerator[Piece, None], Piece] | Response:
        """:meth:`_start` on the event loop."""
        for attempt in (arm, "stable"):
            call.arm, call.version = attempt, version
            # Gateway.relays: every backend of a gateway served on the loop relays (an engine's)
            pieces: AsyncGenerator[Piece, None] = backend.astream(  # type: ignore[attr-defined]
                call.req, call.body.stream)
            try:
                return pieces, await anext(pieces)
            except Exception as exc:
                await pieces.aclose()
                refused = self._start_failed(call, exc)
                if refused is not None:
                    return refused
                version, backend = stable
        raise AssertionError("unreachable")

    def _start_failed(self, call: Call, exc: Exception) -> Response | None:
        """The answer when a generation failed before its first piece; None when a canary
        failed and stable is to serve instead."""
        if isinstance(exc, BadRequestError):
            return oai_error(400, str(exc), arm=call.arm, version=call.version)
        if isinstance(exc, StopIteration | StopAsyncIteration):
            return oai_error(502, f"model {call.version} produced nothing", "server_error", arm=call.arm,
                             version=call.version)
        kind = "upstream" if isinstance(exc, UpstreamError) else "generate"
        GATEWAY_ERRORS.labels(call.arm, call.version, kind).inc()
        if call.arm == "stable":
            return self._failed(call, exc)
        log.warning("%s %s failed, serving from stable: %s", call.arm, call.version, exc)
        GATEWAY_FALLBACKS.inc()
        self.gw.count(call.version, call.arm, True, call.user_key)
        return None

    def _failed(self, call: Call, exc: Exception) -> Response:
        code = exc.status if isinstance(exc, UpstreamError) else 500
        if isinstance(exc, UpstreamError) and code == 400:
            return oai_error(400, str(exc), arm=call.arm, version=call.version)
        self.gw.count(call.version, call.arm, True, call.user_key)
        log.error("%s %s failed: %s", call.arm, call.version, exc)
        return oai_error(code, f"model {call.version} failed: {exc}", "server_error", arm=call.arm,
                         version=call.version)

    def _sse(self, call: Call, pieces: Iterator[Piece], head: Piece) -> Iterator[bytes]:
        events = _Events(call, self.gw.model_name)
        try:
            yield events.piece(head)
            for piece in pieces:
                yield events.piece(piece)
            yield from self._end(events)
        except Exception as exc:
            yield events.failed(exc)
        finally:
            if not events.complete:
                close = getattr(pieces, "close", None)
                if close is not None:
                    close()
                self._streamed(call, events.served)

    async def _asse(self, call: Call, pieces: AsyncGenerator[Piece, None],
                    head: Piece) -> AsyncGenerator[bytes, None]:
        """:meth:`_sse` on the event loop."""
        events = _Events(call, self.gw.model_name)
        try:
            yield events.piece(head)
            async for piece in pieces:
                yield events.piece(piece)
            for tail in self._end(events):
                yield tail
        except Exception as exc:
            yield events.failed(exc)
        finally:
            if not events.complete:
                await pieces.aclose()  # cancelled or closed: the engine's response is closed too
                self._streamed(call, events.served)

    def _end(self, events: _Events) -> list[bytes]:
        """The last events of a whole stream, its exposure logged before they are sent: a client
        that got ``[DONE]`` was served a logged completion, even if the gateway dies next."""
        tail = events.end()
        self._streamed(events.call, events.served)
        return tail

    def _streamed(self, call: Call, served: Served) -> None:
        """A stream ended: what reached the client (all of it, or up to a disconnect) is what was served."""
        if served.tokens and served.problem() is None:
            self._log(call, served)
        else:
            self.gw.count(call.version, call.arm, True, call.user_key)

    # ----------------------------------------------------------------- logging
    def _headers(self, call: Call) -> tuple[tuple[str, str], ...]:
        return (("X-Rtrl-Request-Id", call.request_id), ("X-Rtrl-Arm", call.arm),
                ("X-Rtrl-Model-Version", call.version))

    def _log(self, call: Call, served: Served) -> float:
        """Log the exposure event and count the answer; the latency it records (ms)."""
        latency_ms, gen_s = self._expose(call, served)
        self._tally(call, gen_s)
        return latency_ms

    def _expose(self, call: Call, served: Served) -> tuple[float, float]:
        """Log the exposure event (spooled before the answer is sent): the latency it records
        (ms) and the seconds generation took."""
        gen_s = time.perf_counter() - call.started
        sim_ms = self.gw.settings.simulated_ms_per_token * len(served.tokens)
        latency_ms = round(gen_s * 1000.0 + sim_ms, 3)
        ts = datetime.now(UTC)
        chat = call.kind == "chat"
        verdicts = calls.judge(call.tools, served.tool_calls) if chat else []
        fields = {
            "event_id": uuid.uuid4().hex, "request_id": call.request_id, "ts": ts,
            "session_id": call.session_id, "user_key": call.user_key,
            "model": {"name": self.gw.model_name, "version": call.version}, "arm": call.arm,
            "prompt_tokens": served.prompt_tokens, "completion_tokens": served.tokens,
            "logprobs": served.logprobs, "latency_ms": latency_ms, **answer_fields(chat, served, verdicts),
            "temperature": call.req.temperature,
        }
        if call.turn is not None:
            fields[ALSO] = turns.session_events(call.session_id, call.request_id, call.turn, ts,
                                                served.tool_calls, verdicts)
        self.gw.log_exposure(fields)
        return latency_ms, gen_s

    def _tally(self, call: Call, gen_s: float) -> None:
        """Count one answered request: the judge's served counts and the request metrics."""
        self.gw.count(call.version, call.arm, False)
        GATEWAY_REQUESTS.labels(call.arm, call.version, "200").inc()
        GATEWAY_SECONDS.labels(call.arm).observe(gen_s)


class _Events:
    """The server-sent events of one streamed answer, piece by piece."""

    def __init__(self, call: Call, model_name: str) -> None:
        self.call, self.name = call, model_name
        self.served, self.created = Served(), int(time.time())
        self.first, self.complete = True, False

    def piece(self, piece: Piece) -> bytes:
        call = self.call
        self.served.add(piece)
        shown = piece.client_logprobs if call.req.logprobs is not None else None
        obj = api.chunk(call.kind, call.request_id, self.name, self.created, piece.text, shown,
                        piece.finish_reason, self.first, piece.tool_calls)
        if self.first:
            obj["rtrl"] = {"request_id": call.request_id, "arm": call.arm, "version": call.version}
            self.first = False
        return api.sse(obj)

    def end(self) -> list[bytes]:
        tail = []
        if self.call.body.include_usage:
            tail.append(api.sse(api.usage_chunk(self.call.kind, self.call.request_id, self.name,
                                                self.created, self.served)))
        tail.append(api.sse("[DONE]"))
        self.complete = True
        return tail

    def failed(self, exc: Exception) -> bytes:
        call = self.call
        log.error("%s %s failed while streaming: %s", call.arm, call.version, exc)
        GATEWAY_ERRORS.labels(call.arm, call.version, "stream").inc()
        return api.sse(api.error_body(f"model {call.version} failed while streaming: {exc}",
                                      kind="server_error"))


def _duplicate(call: Call) -> Response:
    return oai_error(409, f"request id {call.request_id} was already served; send a new id per request",
                     err="duplicate_request_id")


async def _off_loop(remote: bool, fn: Callable[[str], Any], request_id: str) -> Any:
    """``fn(request_id)``: in a thread when it goes over the network (Redis), else inline."""
    return await asyncio.to_thread(fn, request_id) if remote else fn(request_id)
