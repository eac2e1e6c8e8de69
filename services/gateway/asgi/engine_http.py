"""A lean HTTP/1.1 client for the relay to one engine: keep-alive connections per event loop,
responses parsed by httptools (llhttp, the parser the gateway's server uses), bodies handed on
as they arrive.

It does what the relay needs and nothing else: ``POST`` a JSON body, read the status and
headers, then the body whole or chunk by chunk (``Content-Length``, chunked, or up to the
close; gzip or deflate decoded). It is the relay's own because a general client costs the
gateway about three times the CPU per request (docs/benchmarks.md, "Where a worker's time goes
at one client"): cookies, redirects, tracing hooks and multidicts the relay never uses.

Limits and failures:
- connect and every wait for the engine's bytes are bounded by ``timeout_s``
  (:class:`asyncio.TimeoutError`); the response head by :data:`HEAD_LIMIT` bytes;
- a malformed response, a connection closed mid-answer or a head over the limit raise
  :class:`EngineHTTPError`; :attr:`EngineHTTPError.before_answer` says the connection closed
  before any byte of the answer, which on a kept-alive connection means the engine closed it
  while idle: the request can be sent again once on a new connection;
- when more than :data:`PAUSE_AT` bytes wait unread, reading from the socket pauses until the
  reader catches up (a fast engine cannot fill the gateway's memory).

A connection goes back to its pool only when its response was read to the end and both sides
keep it alive; anything else closes it, so the engine sees the client leave (vLLM aborts the
generation).
"""

from __future__ import annotations

import asyncio
import ssl
import zlib
from urllib.parse import urlsplit

import httptools

HEAD_LIMIT = 65_536
"""Bytes of status line and headers accepted from an engine."""
PAUSE_AT = 1 << 20
"""Unread body bytes at which reading from the engine's socket pauses."""
KEEPALIVE_S = 30.0
"""An idle connection is closed after this long."""


class EngineHTTPError(Exception):
    """The engine's answer could not be read."""

    def __init__(self, message: str, before_answer: bool = False) -> None:
        super().__init__(message)
        self.before_answer = before_answer


class _StrayError(Exception):
    """A second answer began on the connection before a second request."""


class _Decoder:
    """gzip or deflate bodies, bounded: one chunk may not expand beyond ``limit`` bytes."""

    def __init__(self, coding: str, limit: int) -> None:
        self.limit = limit
        self.obj = zlib.decompressobj(16 + zlib.MAX_WBITS if coding in ("gzip", "x-gzip") else zlib.MAX_WBITS)
        self.raw_deflate = coding == "deflate"

    def __call__(self, data: bytes) -> bytes:
        try:
            out = self.obj.decompress(data, self.limit)
        except zlib.error:
            if not self.raw_deflate:
                raise EngineHTTPError("the engine's compressed answer is corrupt") from None
            # deflate sent without its zlib header, as some servers do
            self.obj, self.raw_deflate = zlib.decompressobj(-zlib.MAX_WBITS), False
            return self(data)
        if self.obj.unconsumed_tail:
            raise EngineHTTPError(f"the engine's compressed answer expands beyond {self.limit} bytes")
        return out


class Connection(asyncio.Protocol):
    """One keep-alive connection to the engine, carrying one request at a time."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.idle_timer: asyncio.TimerHandle | None = None
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.head_bytes = self.field_bytes = 0
        self.head_done = False
        self.complete = False
        self.got_bytes = False
        self.failure: EngineHTTPError | None = None
        self.body: list[bytes] = []
        self.unread = 0
        self.paused = False
        self.waiter: asyncio.Future[None] | None = None
        self.decode: _Decoder | None = None
        self.keep = False

    # ----------------------------------------------------------------- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.complete:  # bytes after the answer, before another request
            self._stray()
            return
        self.got_bytes = True
        if not self.head_done:
            self.head_bytes += len(data)
        try:
            self.parser.feed_data(data)
            if not self.head_done and self.head_bytes > HEAD_LIMIT:  # one endless header holds no callback
                raise EngineHTTPError(f"the engine's response head is over {HEAD_LIMIT} bytes")
        except httptools.HttpParserUpgrade:
            self._fail(EngineHTTPError("the engine answered with a protocol upgrade"))
        except EngineHTTPError as exc:
            self._fail(exc)
        except httptools.HttpParserError as exc:
            cause = exc.__context__  # raised by a callback of ours: a limit, an encoding, stray bytes
            if isinstance(cause, _StrayError):
                self._stray()
                return
            self._fail(cause if isinstance(cause, EngineHTTPError)
                       else EngineHTTPError(f"the engine's answer is malformed: {exc}"))

    def eof_received(self) -> bool:
        return False  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        if self.idle_timer is not None:
            self.idle_timer.cancel()
        if self.head_done and not self.complete and not self._framed():
            self.complete = True  # a body that ends with the connection
        elif not self.complete:
            why = f": {exc}" if exc else ""
            self._fail(EngineHTTPError(f"the engine closed the connection{why}", not self.got_bytes))
        self.transport = None
        self._wake()

    def pause_writing(self) -> None:  # a request body is small; nothing to hold back
        pass

    def resume_writing(self) -> None:
        pass

    def _stray(self) -> None:
        """The engine sent more than its answer: the answer stands, the connection is not reused."""
        self.keep = False
        if self.transport is not None:
            self.transport.close()

    # ----------------------------------------------------------------- httptools callbacks
    def on_message_begin(self) -> None:
        if self.complete:
            raise _StrayError()

    def on_header(self, name: bytes, value: bytes) -> None:
        self.field_bytes += len(name) + len(value) + 4
        if self.field_bytes > HEAD_LIMIT:  # a whole head that came in one read
            raise EngineHTTPError(f"the engine's response head is over {HEAD_LIMIT} bytes")
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        self.headers[key] = f"{self.headers[key]}, {text}" if key in self.headers else text

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.head_done = True
        coding = self.headers.get("content-encoding", "identity").strip().lower()
        if coding in ("gzip", "x-gzip", "deflate"):
            self.decode = _Decoder(coding, PAUSE_AT * 64)
        elif coding not in ("identity", ""):
            raise EngineHTTPError(f"the engine's answer is encoded as {coding!r}, which the relay cannot "
                                  "read")
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self.unread += len(body)
        if self.unread > PAUSE_AT and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep = self.parser.should_keep_alive()
        self._wake()

    # ----------------------------------------------------------------- the client's side
    def _framed(self) -> bool:
        return "content-length" in self.headers or "chunked" in self.headers.get("transfer-encoding", "")

    def _fail(self, exc: EngineHTTPError) -> None:
        if self.failure is None:
            self.failure = exc
        if self.transport is not None:
            self.transport.close()
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def _wait(self) -> None:
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(self.timeout_s):
                await self.waiter
        finally:
            self.waiter = None

    @property
    def usable(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    def send(self, request: bytes) -> None:
        self._reset()
        assert self.transport is not None
        self.transport.write(request)

    async def head(self) -> None:
        """Wait for the status line and headers."""
        while not self.head_done:
            if self.failure is not None:
                raise self.failure
            if self.transport is None:
                raise EngineHTTPError("the engine closed the connection", not self.got_bytes)
            await self._wait()

    async def chunk(self) -> bytes:
        """The body bytes that arrived since the last call (decoded); b"" at the end."""
        while not self.body:
            if self.failure is not None:
                raise self.failure
            if self.complete:
                return b""
            if self.transport is None:
                raise EngineHTTPError("the engine closed the connection mid-answer")
            await self._wait()
        data = self.body[0] if len(self.body) == 1 else b"".join(self.body)
        self.body.clear()
        self.unread = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return self.decode(data) if self.decode is not None else data

    @property
    def reusable(self) -> bool:
        return self.complete and self.keep and self.failure is None and self.usable

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class Pool:
    """Keep-alive connections to one engine from one event loop, at most ``limit`` in use."""

    def __init__(self, base_url: str, headers: dict[str, str], timeout_s: float, limit: int) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in {"http", "https"} or not parts.hostname:
            raise ValueError(f"base_url {base_url!r} must be http(s)://host[:port][/path]")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.prefix = parts.path.rstrip("/")
        fields = {"Host": parts.netloc.rpartition("@")[2], **headers}
        self.fields = "".join(f"{k}: {v}\r\n" for k, v in fields.items()).encode("latin-1")
        self.timeout_s = timeout_s
        self.idle: list[Connection] = []
        self.slots = asyncio.Semaphore(limit)
        self.closed = False

    def request(self, path: str, payload: bytes) -> bytes:
        return b"".join((b"POST ", (self.prefix + path).encode("ascii"), b" HTTP/1.1\r\n", self.fields,
                         b"Content-Length: %d\r\n\r\n" % len(payload), payload))

    async def take(self) -> tuple[Connection, bool]:
        """A connection for one request, and whether it was kept alive from an earlier one.
        The caller gives it back with :meth:`give` (or :meth:`drop`)."""
        await self.slots.acquire()
        try:
            while self.idle:
                conn = self.idle.pop()
                if conn.idle_timer is not None:
                    conn.idle_timer.cancel()
                if conn.usable:
                    return conn, True
            return await self._connect(), False
        except BaseException:
            self.slots.release()
            raise

    async def _connect(self) -> Connection:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.timeout_s):
            _, proto = await loop.create_connection(
                lambda: Connection(self.timeout_s), self.host, self.port, ssl=self.ssl,
                server_hostname=self.host if self.ssl else None)
        return proto

    def give(self, conn: Connection) -> None:
        """Back to the pool when its answer was read to the end; closed otherwise."""
        self.slots.release()
        if conn.reusable and not self.closed:
            conn.idle_timer = asyncio.get_running_loop().call_later(KEEPALIVE_S, conn.close)
            self.idle.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        self.closed = True
        while self.idle:
            self.idle.pop().close()
