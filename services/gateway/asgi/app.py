"""The gateway's HTTP server: :class:`Gateway` as an ASGI application on uvicorn (httptools).

The parser is httptools (llhttp); the connection limits are services/gateway/asgi/protocol.py.
Per request, the application (:class:`GatewayApp`) reads the body within ``read_timeout_s``
and ``max_body_bytes``, then runs ``Gateway.handle`` on a thread pool: the gateway's work is
a blocking engine call or a CPU-bound local policy, which must not stall the event loop that
serves every other connection. A streamed answer is iterated in the same pool thread that
started it and each chunk is written as it comes; when the client goes away the thread stops
at the next chunk and closes the stream, which closes the engine's stream too and logs what
was served.

:class:`GatewayServer` runs one uvicorn server in a background thread on a socket it binds
itself (so ``port=0`` works and the port is known before the first request).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, TypeVar

import uvicorn

from ingest.contracts.prometheus import GATEWAY_ERRORS, GATEWAY_REQUESTS
from services.gateway.asgi.protocol import guarded_protocol
from services.gateway.asgi.relay import close_all
from services.gateway.openai_api import Response, error_response
from services.gateway.server import Gateway

log = logging.getLogger(__name__)
T = TypeVar("T")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
Outbox = asyncio.Queue[tuple[str, Any]]
"""What a request's pool thread hands the event loop: ("response", Response), then for a
stream ("chunk", bytes)... and ("end", None); ("gone", None) when the client left."""

SINGLE_HEADERS = frozenset({"authorization", "content-type", "x-rtrl-user", "x-rtrl-session-id",
                            "x-rtrl-turn", "x-request-id"})
"""Headers that must not appear twice: which copy counts would be a guess."""
CLOSE = ("Connection", "close")


class RequestHeaders:
    """A request's headers, looked up case-insensitively (the first of repeated ones)."""

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self._map: dict[str, str] = {}
        self.repeated: str | None = None
        for name, value in raw:
            key = name.decode("latin-1").lower()
            if key in self._map:
                if key in SINGLE_HEADERS:
                    self.repeated = key
                continue
            self._map[key] = value.decode("latin-1")

    def get(self, name: str, default: None = None, /) -> str | None:
        return self._map.get(name.lower(), default)


class GatewayApp:
    """The ASGI application (HTTP only; no lifespan, no websockets)."""

    def __init__(self, gateway: Gateway, pool: ThreadPoolExecutor) -> None:
        self.gateway = gateway
        self.settings = gateway.settings
        self.pool = pool

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        headers = RequestHeaders(scope["headers"])
        refused = self._precheck(scope["path"], headers)
        if refused is not None:
            await self._send_whole(send, refused)
            return
        body = await self._body(receive, headers)
        if isinstance(body, Response):
            await self._send_whole(send, body)
        elif body is None:  # the client left
            return
        elif not self.gateway.relays(scope["method"], scope["path"]) or \
                not await self._relay(scope, receive, send, body, headers):
            await self._serve(scope, receive, send, body, headers)

    def _precheck(self, path: str, headers: RequestHeaders) -> Response | None:
        """What is refused on the headers alone, before the body is read: ambiguous headers, a
        transfer coding that cannot be decoded, a missing or wrong API key (authentication
        comes before the API's own checks)."""
        coding = headers.get("transfer-encoding")
        if headers.repeated is not None:
            return self._refused(400, f"the {headers.repeated} header appears more than once")
        if coding is not None and coding.strip().lower() != "chunked":
            return self._refused(501, f"transfer coding {coding[:60]!r} is not supported: send the body "
                                      "as is (Content-Length) or chunked")
        refused = self.gateway.authenticate(path, headers)
        if refused is not None and (headers.get("content-length") not in (None, "0") or coding is not None):
            refused = replace(refused, headers=(*refused.headers, CLOSE))  # its body stays unread
        return refused

    # ----------------------------------------------------------------- request
    async def _body(self, receive: Receive, headers: RequestHeaders) -> bytes | Response | None:
        """The whole body; a 413 or 408 Response (closing the connection); None on disconnect."""
        limit = self.settings.max_body_bytes
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return self._refused(413, f"request body of {declared} bytes exceeds the limit of {limit}")
        parts: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.settings.read_timeout_s):  # one timer, not a task per read
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        return self._refused(413, f"request body exceeds the limit of {limit} bytes")
                    parts.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(parts)
        except TimeoutError:
            return self._refused(408, f"request body not received within {self.settings.read_timeout_s:g} s")

    @staticmethod
    def _refused(status: int, message: str) -> Response:
        GATEWAY_REQUESTS.labels("none", "none", str(status)).inc()
        return error_response(status, message, headers=(CLOSE,))

    def _call(self, method: str, path: str, body: bytes, headers: RequestHeaders) -> Response:
        try:
            return self.gateway.handle(method, path, body, headers.get("content-type"), headers,
                                       authenticated=True, defer=True)
        except Exception as exc:  # a bug answers 500; the server keeps serving
            log.exception("unhandled error on %s %s", method, path)
            GATEWAY_ERRORS.labels("none", "none", "internal").inc()
            return error_response(500, f"internal error: {type(exc).__name__}")

    # ----------------------------------------------------------------- response
    @staticmethod
    def _head(resp: Response, *extra: tuple[bytes, bytes]) -> dict[str, Any]:
        headers = [(b"content-type", resp.content_type.encode("latin-1")), *extra]
        headers += [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in resp.headers]
        return {"type": "http.response.start", "status": resp.code, "headers": headers}

    async def _send_whole(self, send: Send, resp: Response) -> None:
        await send(self._head(resp, (b"content-length", str(len(resp.body)).encode())))
        await send({"type": "http.response.body", "body": resp.body})

    async def _relay(self, scope: Scope, receive: Receive, send: Send, body: bytes,
                     headers: RequestHeaders) -> bool:
        """Serve a generation request on the event loop (its model is on an engine). The work
        runs in this task and is cancelled when the client leaves, which closes the engine's
        response. False: it is not one to serve here after all (the token-id API)."""
        finished, resp = await _unless_gone(self._ahandle(scope["path"], body, headers), receive)
        if not finished:
            return True
        if resp is None:
            return False
        if resp.astream is None:
            await self._send_whole(send, resp)
            _after(resp)
            return True
        await send(self._head(resp, (b"cache-control", b"no-cache")))
        await _unless_gone(_pump(send, resp.astream), receive)
        return True

    async def _ahandle(self, path: str, body: bytes, headers: RequestHeaders) -> Response | None:
        try:
            return await self.gateway.ahandle(path, body, headers.get("content-type"), headers, defer=True)
        except Exception as exc:  # a bug answers 500; the server keeps serving
            log.exception("unhandled error on POST %s", path)
            GATEWAY_ERRORS.labels("none", "none", "internal").inc()
            return error_response(500, f"internal error: {type(exc).__name__}")

    async def _serve(self, scope: Scope, receive: Receive, send: Send, body: bytes,
                     headers: RequestHeaders) -> None:
        """Run the request on the pool and send what it answers. A whole answer is sent once
        it is ready; a stream chunk by chunk as the pool thread produces it."""
        loop = asyncio.get_running_loop()
        out: Outbox = asyncio.Queue()
        gone = threading.Event()
        job = loop.run_in_executor(self.pool, self._run, loop, out, gone, scope["method"], scope["path"],
                                   body, headers)
        _, resp = await out.get()
        if resp.stream is None:
            await self._send_whole(send, resp)
            _after(resp)
            await job
            return
        watcher = asyncio.create_task(_watch_disconnect(receive, gone, out))
        try:
            await send(self._head(resp, (b"cache-control", b"no-cache")))
            while True:
                kind, chunk = await out.get()
                if kind == "end":
                    if not gone.is_set():
                        await send({"type": "http.response.body", "body": b"", "more_body": False})
                    break
                if kind == "chunk" and not gone.is_set():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            gone.set()  # also when this task is cancelled: the pool thread stops at its next chunk
            watcher.cancel()

    def _run(self, loop: asyncio.AbstractEventLoop, out: Outbox, gone: threading.Event,
             method: str, path: str, body: bytes, headers: RequestHeaders) -> None:
        """The pool thread's part: the request, and for a stream every chunk and its close,
        all in this one thread. A stream must not move between threads: an engine backend
        keeps one connection per thread, which the thread's next request would reuse while
        the stream is still reading from it."""

        def put(kind: str, item: Any) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone: the server stopped
                loop.call_soon_threadsafe(out.put_nowait, (kind, item))

        resp = self._call(method, path, body, headers)
        put("response", resp)
        if resp.stream is None:
            return
        try:
            for chunk in resp.stream:
                if gone.is_set():
                    break  # the client left: closing the stream closes the engine's too
                if chunk:
                    put("chunk", chunk)
        except Exception:  # the routes turn engine failures into an error event; this is a bug
            log.exception("stream failed on %s %s", method, path)
        finally:
            close = getattr(resp.stream, "close", None)
            if close is not None:
                close()
            put("end", None)


def _after(resp: Response) -> None:
    """A whole answer's deferred bookkeeping, run once its bytes are out: the connection
    (services/gateway/asgi/protocol.py, ``OnePass``) writes them in the loop's next pass, and
    this runs right after, in the same pass."""
    if resp.after is not None:
        asyncio.get_running_loop().call_soon(_run_after, resp.after)


def _run_after(after: Callable[[], object]) -> None:
    try:
        after()
    except Exception:  # bookkeeping must never take the server down
        log.exception("bookkeeping after an answer failed")


async def _unless_gone(work: Awaitable[T], receive: Receive) -> tuple[bool, T | None]:
    """(True, what ``work`` returns) once it is done, run in this task (no task of its own,
    no hop back); (False, None) when the client left first: this task is cancelled at its
    next await, the work cleans up (an engine response is closed), and the cancellation ends
    here. A cancellation of the task from elsewhere (the server stopping) still propagates."""
    task = asyncio.current_task()
    assert task is not None
    gone = False

    def leave(watcher: asyncio.Future[None]) -> None:
        nonlocal gone
        if not watcher.cancelled():
            gone = True
            task.cancel()

    watcher = asyncio.ensure_future(_disconnected(receive))
    watcher.add_done_callback(leave)
    try:
        return True, await work
    except asyncio.CancelledError:
        if gone and task.uncancel() == 0:
            return False, None
        raise
    finally:
        watcher.remove_done_callback(leave)
        watcher.cancel()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _pump(send: Send, stream: AsyncGenerator[bytes, None]) -> None:
    """Send an async stream's chunks as they come, then end the body."""
    try:
        async for chunk in stream:
            if chunk:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    finally:
        await stream.aclose()


async def _lifespan(receive: Receive, send: Send) -> None:
    """Start-up has nothing to do; at shutdown the engine relays' sessions on this loop close."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await close_all()
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _watch_disconnect(receive: Receive, gone: threading.Event, out: Outbox) -> None:
    await _disconnected(receive)
    gone.set()
    out.put_nowait(("gone", None))


# --------------------------------------------------------------------- server


def listen_socket(host: str, port: int, backlog: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say they are TCP,
    # and without it every answer written in two parts waits ~40 ms for the client's delayed ACK
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    sock.set_inheritable(True)
    return sock


class GatewayServer:
    """uvicorn around a :class:`Gateway`, in a background thread: ``start()``, ``port``,
    ``stop(drain_s)``."""

    def __init__(self, gateway: Gateway, host: str, port: int, sock: socket.socket | None = None) -> None:
        s = gateway.settings
        self.gateway = gateway
        self._sock = sock or listen_socket(host, port, s.listen_backlog)
        self._pool = ThreadPoolExecutor(max_workers=s.max_connections, thread_name_prefix="gateway")
        config = uvicorn.Config(
            GatewayApp(gateway, self._pool), http=guarded_protocol(s), lifespan="on", log_config=None,
            access_log=False, server_header=False, timeout_keep_alive=s.idle_timeout_s,  # type: ignore[arg-type]
            backlog=s.listen_backlog, timeout_graceful_shutdown=5, loop="uvloop",
            proxy_headers=False)  # nothing reads X-Forwarded-*: the caps count the peer address
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="http", daemon=True)

    @property
    def port(self) -> int:
        return int(self._sock.getsockname()[1])

    def start(self, timeout_s: float = 30.0) -> GatewayServer:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the gateway's HTTP server did not start (see the log)")
            time.sleep(0.01)
        return self

    def stop(self, drain_s: float = 5.0) -> None:
        """Stop accepting, let requests in flight finish for up to ``drain_s``, close all."""
        self._server.config.timeout_graceful_shutdown = max(1, round(drain_s))
        self._server.should_exit = True
        self._thread.join(drain_s + 5.0)
        self._pool.shutdown(wait=False, cancel_futures=True)
