"""The asynchronous relay to an OpenAI-compatible engine (vLLM, or any upstream server).

The gateway's generation routes run on uvicorn's event loop when their model is on an engine:
no thread per request, no hop between the loop and a pool. :class:`AsyncEngineClient` holds
one pool of keep-alive connections to the engine per event loop (services/gateway/asgi/
engine_http.py: httptools parses the answers) and turns one request into an async iterator of
:class:`~services.gateway.generation.Piece` s with the same parsing as the blocking client
(services/gateway/engine_backend.py). A streamed answer is relayed chunk by chunk as the engine
sends it, never buffered. When the request's task is cancelled (the client went away) the
engine's connection is closed: vLLM sees it drop and aborts the generation.

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
from collections.abc import AsyncGenerator, Iterator
from typing import Any
from urllib.parse import urlsplit

from services.gateway.asgi.engine_http import Connection, EngineHTTPError, Pool
from services.gateway.engine_backend import engine_body, error_answer, parse_choice, sse_event
from services.gateway.generation import GenRequest, Piece, UpstreamError

log = logging.getLogger(__name__)

ERROR_BODY_LIMIT = 65_536
"""Bytes of an engine's error answer read for its message."""
ANSWER_LIMIT = 64 << 20
"""Bytes of a whole answer read at most: an engine answering more is refused with 502, not
held in memory."""
LINE_LIMIT = 1 << 20
"""Bytes of one server-sent event line at most."""
TAIL_LIMIT = 65_536
"""Bytes read after a stream's ``[DONE]`` so its connection can be reused; more is not an engine we know."""
_CLIENTS: weakref.WeakSet[AsyncEngineClient] = weakref.WeakSet()


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
        # no Accept-Encoding: compressing on the engine and decompressing here costs both sides
        # CPU for a loopback or in-cluster hop; a server that compresses anyway is decoded
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self._pools: dict[asyncio.AbstractEventLoop, Pool] = {}
        _CLIENTS.add(self)

    # ----------------------------------------------------------------- pools
    def _pool(self) -> Pool:
        loop = asyncio.get_running_loop()
        pool = self._pools.get(loop)
        if pool is None or pool.closed:
            for old in [lp for lp in self._pools if lp.is_closed()]:
                del self._pools[old]  # a stopped server's loop: its sockets went with it
            pool = self._pools[loop] = Pool(self.base_url, self.headers, self.timeout_s, self.max_connections)
        return pool

    async def aclose(self) -> None:
        """Close this loop's connections."""
        pool = self._pools.pop(asyncio.get_running_loop(), None)
        if pool is not None:
            pool.close()

    def close(self) -> None:
        """Close every loop's connections (a backend that is no longer served), from any thread."""
        for loop, pool in list(self._pools.items()):
            self._pools.pop(loop, None)
            if not loop.is_closed():
                with contextlib.suppress(RuntimeError):  # the loop stopped meanwhile
                    loop.call_soon_threadsafe(pool.close)

    # ----------------------------------------------------------------- requests
    async def _open(self, path: str, body: dict[str, Any]) -> tuple[Pool, Connection]:
        """A connection on which the engine has answered ``body``'s status and headers. A
        kept-alive connection the engine closed before answering is replaced (a new one never
        is)."""
        pool = self._pool()
        request = pool.request(path, json.dumps(body).encode())
        while True:
            conn, reused = await self._take(pool)
            try:
                conn.send(request)
                await conn.head()
                return pool, conn
            except TimeoutError:
                pool.give(conn)
                raise UpstreamError(504, f"{self.name} did not answer within {self.timeout_s:g}s") from None
            except EngineHTTPError as exc:
                pool.give(conn)
                if not (reused and exc.before_answer):
                    raise UpstreamError(502, f"{self.name} unreachable: {exc}") from None
            except BaseException:
                pool.give(conn)
                raise

    @contextlib.contextmanager
    def _failures(self, timed_out: str, failed: str) -> Iterator[None]:
        """A timeout as 504, a connection or an answer that failed as 502, saying what was done."""
        try:
            yield
        except TimeoutError:  # before OSError: it is one
            raise UpstreamError(504, f"{self.name} {timed_out} {self.timeout_s:g}s") from None
        except (OSError, EngineHTTPError) as exc:
            raise UpstreamError(502, f"{self.name} {failed}: {exc}") from None

    async def _take(self, pool: Pool) -> tuple[Connection, bool]:
        with self._failures("took no connection in", "unreachable"):
            return await pool.take()

    async def pieces(self, model: str, req: GenRequest, stream: bool = True) -> AsyncGenerator[Piece, None]:
        """The engine's answer to ``req`` as pieces: one for a whole answer, one per server-sent
        event for a stream. Closing the iterator early closes the engine's connection."""
        path = "/v1/chat/completions" if req.kind == "chat" else "/v1/completions"
        pool, conn = await self._open(path, engine_body(req, model, stream))
        try:
            if conn.status != 200:
                raise await self._error(conn)
            if not stream:
                yield parse_choice(req.kind, await self._read_json(conn))
                return
            async with contextlib.aclosing(self._events(req.kind, conn)) as events:
                async for piece in events:
                    yield piece
            await _drain(conn)
        finally:
            pool.give(conn)  # kept only when read to its end: otherwise closed, and the engine sees it

    async def _read(self, conn: Connection, what: str) -> bytes:
        with self._failures(f"{what} timed out after", f"{what} failed"):
            return await conn.chunk()

    async def _read_json(self, conn: Connection) -> Any:
        raw = bytearray()
        while chunk := await self._read(conn, "read"):
            raw += chunk
            if len(raw) > ANSWER_LIMIT:
                raise UpstreamError(502, f"{self.name} answered more than {ANSWER_LIMIT} bytes")
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise UpstreamError(502, f"{self.name} read failed: {exc}") from None

    async def _error(self, conn: Connection) -> UpstreamError:
        raw = bytearray()
        with contextlib.suppress(UpstreamError):
            while len(raw) < ERROR_BODY_LIMIT and (chunk := await self._read(conn, "read")):
                raw += chunk
        return error_answer(conn.status, bytes(raw[:ERROR_BODY_LIMIT]))

    async def _events(self, kind: str, conn: Connection) -> AsyncGenerator[Piece, None]:
        buf = b""
        while chunk := await self._read(conn, "stream"):
            buf += chunk
            *lines, buf = buf.split(b"\n")
            if len(buf) > LINE_LIMIT:
                raise UpstreamError(502, f"{self.name} stream broke: a line over {LINE_LIMIT} bytes")
            for line in lines:
                try:
                    event = sse_event(kind, line)
                except ValueError as exc:
                    raise UpstreamError(502, f"{self.name} stream broke: {exc}") from None
                if isinstance(event, Piece):
                    yield event
                elif event == "done":
                    return
        raise UpstreamError(502, f"{self.name} stream ended without [DONE]")


async def _drain(conn: Connection, wait_s: float = 2.0) -> None:
    """Read what follows a stream's ``[DONE]`` (the closing chunk), up to ``wait_s`` and
    ``TAIL_LIMIT`` bytes, so the connection can carry the next request."""
    read = 0
    with contextlib.suppress(TimeoutError, EngineHTTPError):
        async with asyncio.timeout(wait_s):
            while read <= TAIL_LIMIT and (chunk := await conn.chunk()):
                read += len(chunk)
    if read > TAIL_LIMIT:
        conn.close()


async def close_all() -> None:
    """Close every client's session on the running loop (the server's shutdown)."""
    for client in list(_CLIENTS):
        await client.aclose()
