"""The asynchronous relay to an OpenAI-compatible engine (vLLM, or any upstream server).

The gateway's generation routes run on uvicorn's event loop when their model is on an engine:
no thread per request, no hop between the loop and a pool. :class:`AsyncEngineClient` holds
one aiohttp session per event loop (an aiohttp session is bound to the loop that made it), a
pool of keep-alive connections to the engine, and turns one request into an async iterator of
:class:`~services.gateway.generation.Piece` s with the same parsing as the blocking client
(services/gateway/engine_backend.py). A streamed answer is relayed chunk by chunk as the engine
sends it, never buffered. When the request's task is cancelled (the client went away) the
engine's response is closed: vLLM sees its connection drop and aborts the generation.

Errors map as in the blocking client: no answer within ``timeout_s`` is 504; an unreachable
engine, a broken stream or an unparsable answer is 502; the engine's own 400/413/422 pass
through as 400.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import weakref
from collections.abc import AsyncGenerator
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from services.gateway.engine_backend import engine_body, error_answer, parse_choice, sse_event
from services.gateway.generation import GenRequest, Piece, UpstreamError

log = logging.getLogger(__name__)

ERROR_BODY_LIMIT = 65_536
"""Bytes of an engine's error answer read for its message."""
ANSWER_LIMIT = 64 << 20
"""Bytes of a whole answer read at most: an engine answering more is refused with 502, not
held in memory."""
TAIL_LIMIT = 65_536
"""Bytes read after a stream's ``[DONE]`` so its connection can be reused; more is not an engine we know."""
_CLIENTS: weakref.WeakSet[AsyncEngineClient] = weakref.WeakSet()

RETRYABLE = (aiohttp.ServerDisconnectedError, aiohttp.ClientConnectionResetError)
"""A kept-alive connection the engine closed before answering: sent again once on a new one."""


class AsyncEngineClient:
    """HTTP/1.1 to one engine over pooled keep-alive connections, from any event loop."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 60.0,
                 name: str = "engine", max_connections: int = 1024) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in {"http", "https"} or not parts.hostname:
            raise ValueError(f"{name} base_url {base_url!r} must be http(s)://host[:port][/path]")
        self.name = name
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.max_connections = max_connections
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self._sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}
        _CLIENTS.add(self)

    # ----------------------------------------------------------------- sessions
    def _session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        session = self._sessions.get(loop)
        if session is None or session.closed:
            for old in [lp for lp in self._sessions if lp.is_closed()]:
                del self._sessions[old]  # a stopped server's loop: its sockets went with it
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.timeout_s, sock_read=self.timeout_s)
            connector = aiohttp.TCPConnector(limit=self.max_connections, keepalive_timeout=30.0)
            # no Accept-Encoding: compressing on the engine and decompressing here costs both
            # sides CPU for a loopback or in-cluster hop; a server that compresses anyway is
            # decompressed
            session = aiohttp.ClientSession(connector=connector, timeout=timeout, headers=self.headers,
                                            read_bufsize=1 << 20, max_line_size=1 << 20,
                                            skip_auto_headers=("User-Agent", "Accept-Encoding"))
            self._sessions[loop] = session
        return session

    async def aclose(self) -> None:
        """Close this loop's session."""
        session = self._sessions.pop(asyncio.get_running_loop(), None)
        if session is not None:
            await session.close()

    def close(self) -> None:
        """Close every loop's session (a backend that is no longer served), from any thread."""
        for loop, session in list(self._sessions.items()):
            self._sessions.pop(loop, None)
            if not loop.is_closed():
                with contextlib.suppress(RuntimeError):  # the loop stopped meanwhile
                    asyncio.run_coroutine_threadsafe(session.close(), loop)


    # ----------------------------------------------------------------- requests
    async def _open(self, path: str, body: dict[str, Any]) -> aiohttp.ClientResponse:
        payload = json.dumps(body).encode()
        for attempt in (0, 1):
            try:
                return await self._session().post(self.base_url + path, data=payload)
            except TimeoutError:
                raise UpstreamError(504, f"{self.name} did not answer within {self.timeout_s:g}s") from None
            except RETRYABLE as exc:
                if attempt == 1:
                    raise UpstreamError(502, f"{self.name} unreachable: {exc}") from None
            except aiohttp.ClientError as exc:
                raise UpstreamError(502, f"{self.name} unreachable: {exc}") from None
        raise AssertionError("unreachable")

    async def pieces(self, model: str, req: GenRequest, stream: bool = True) -> AsyncGenerator[Piece, None]:
        """The engine's answer to ``req`` as pieces: one for a whole answer, one per server-sent
        event for a stream. Closing the iterator early closes the engine's response."""
        path = "/v1/chat/completions" if req.kind == "chat" else "/v1/completions"
        resp = await self._open(path, engine_body(req, model, stream))
        reusable = False
        try:
            if resp.status != 200:
                raise await self._error(resp)
            if not stream:
                data = await self._read_json(resp)
                reusable = True
                yield parse_choice(req.kind, data)
                return
            async with contextlib.aclosing(self._events(req.kind, resp)) as events:
                async for piece in events:
                    yield piece
            reusable = await _drain(resp)
        finally:
            if reusable:
                resp.release()
            else:
                resp.close()  # half read (or the client left): the connection cannot carry another

    async def _read_json(self, resp: aiohttp.ClientResponse) -> Any:
        raw = bytearray()
        try:
            while chunk := await resp.content.read(1 << 16):
                raw += chunk
                if len(raw) > ANSWER_LIMIT:
                    raise UpstreamError(502, f"{self.name} answered more than {ANSWER_LIMIT} bytes")
            return json.loads(raw)
        except TimeoutError:
            raise UpstreamError(504, f"{self.name} read timed out after {self.timeout_s:g}s") from None
        except (aiohttp.ClientError, ValueError) as exc:
            raise UpstreamError(502, f"{self.name} read failed: {exc}") from None

    async def _error(self, resp: aiohttp.ClientResponse) -> UpstreamError:
        try:
            raw = await resp.content.read(ERROR_BODY_LIMIT)
        except (TimeoutError, aiohttp.ClientError):
            raw = b""
        return error_answer(resp.status, raw)

    async def _events(self, kind: str, resp: aiohttp.ClientResponse) -> AsyncGenerator[Piece, None]:
        try:
            while line := await resp.content.readline():
                event = sse_event(kind, line)
                if isinstance(event, Piece):
                    yield event
                elif event == "done":
                    return
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            raise UpstreamError(502, f"{self.name} stream broke: {exc or type(exc).__name__}") from None
        raise UpstreamError(502, f"{self.name} stream ended without [DONE]")


async def _drain(resp: aiohttp.ClientResponse, wait_s: float = 2.0) -> bool:
    """Read what follows a stream's ``[DONE]`` (the closing chunk); True when the response
    ended within ``wait_s`` and ``TAIL_LIMIT`` bytes, so its connection can be reused."""
    read = 0
    with contextlib.suppress(TimeoutError, aiohttp.ClientError):
        async with asyncio.timeout(wait_s):
            while not resp.content.at_eof() and read <= TAIL_LIMIT:
                read += len(await resp.content.readany())
        return resp.content.at_eof()
    return False


async def close_all() -> None:
    """Close every client's session on the running loop (the server's shutdown)."""
    for client in list(_CLIENTS):
        await client.aclose()
