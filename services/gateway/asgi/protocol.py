"""The connection guard: uvicorn's httptools protocol with the limits that keep a flood of
connections from starving real users (docs/gateway.md, "HTTP server").

httptools (llhttp) parses and rejects malformed framing: duplicate, negative or non-numeric
``Content-Length``, ``Transfer-Encoding`` beside ``Content-Length``, obsolete line folding,
bare LF line ends. This class adds what uvicorn leaves open, per connection, before any
request reaches the application:

* **caps**: at most ``max_connections`` open connections in this process and
  ``max_connections_per_client`` per client address (one more: ``429``
  ``rate_limit_exceeded``). When the process is full, the connection that has waited longest
  without sending a request (new and silent, or idle between keep-alive requests) is closed
  to make room, so silent connections cannot lock real clients out; only when every open
  connection is busy with a request is the new one answered ``503`` with ``Retry-After``;
* **a header timeout**: a new connection must deliver its first request's line and headers
  within ``header_timeout_s``, and so must every later request from its first byte; a silent
  connection is closed, a trickling one gets ``408``;
* **size limits**: request line ``max_request_line_bytes`` (``414``), header block
  ``max_header_bytes`` or more than :data:`MAX_HEADERS` headers (``431``);
* **JSON errors**: the parser's ``400`` is OpenAI's error object, like every other error.

Each refusal is counted in ``rtrl_gateway_connections_closed_total{reason}``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, OrderedDict
from collections.abc import Iterable
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ingest.contracts.prometheus import GATEWAY_CONNECTIONS, GATEWAY_OPEN_CONNECTIONS, GATEWAY_REQUESTS
from services.gateway.openai_api import error_bytes
from services.settings.services import GatewaySettings

PARSER_LOG = logging.getLogger(__name__)
"""uvicorn warns once per malformed request; refusals are counted in metrics instead, so a
flood of bad requests does not flood the log (set this logger to WARNING to see them)."""
PARSER_LOG.setLevel(logging.ERROR)
MAX_HEADERS = 100
LINGER_S = 1.0
"""A refused connection's input is read and dropped for this long before it is closed:
closing a socket with unread input sends a reset that can destroy the answer in flight."""


class OnePass:
    """The transport as one request's response sees it: what is written within one pass of
    the event loop goes out in one ``write``. uvicorn writes a response's status line and
    headers, then its body, in two calls; on two sockets that is two segments, and a client
    woken by the first parses the head while the gateway waits to send the rest. Held bytes
    go out in the loop's next pass, ahead of anything scheduled after them (a later request on
    the connection, the answer's bookkeeping): a stream's chunks wait no longer than that."""

    __slots__ = ("_loop", "_parts", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport, self._loop = transport, loop
        self._parts: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._parts:
            self._loop.call_soon(self.flush)
        self._parts.append(data)

    def writelines(self, data: Iterable[bytes]) -> None:
        for part in data:
            self.write(part)

    def flush(self) -> None:
        parts, self._parts = self._parts, []
        if parts and not self._transport.is_closing():
            self._transport.write(parts[0] if len(parts) == 1 else b"".join(parts))

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class Refusal(Exception):  # noqa: N818 (a refusal, not a failure)
    """Raised from a parser callback: answer ``status`` and close."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status, self.reason = status, reason


def guarded_protocol(settings: GatewaySettings) -> type[HttpToolsProtocol]:
    """The protocol class for one server (uvicorn ``Config(http=...)``); its connection
    counts are shared by the server's connections and no one else's."""
    shared = {"limits": settings, "per_client": Counter(), "waiting": OrderedDict()}
    return type("GuardedProtocol", (GuardedProtocol,), shared)


class GuardedProtocol(HttpToolsProtocol):
    limits: GatewaySettings
    per_client: Counter[str]
    waiting: OrderedDict[GuardedProtocol, None]
    """Admitted connections with no request under way, oldest first: the ones to evict."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.logger = PARSER_LOG
        self._admitted = False
        self._header_timer: asyncio.TimerHandle | None = None
        self._in_head = True  # between requests or inside a request's line and headers
        self._began = False  # a request's first byte has arrived
        self._head_bytes = 0
        self._headers_seen = 0
        self._refused = False
        self._refusal: Refusal | None = None

    # ----------------------------------------------------------------- connections
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        host = self.client[0] if self.client else "?"
        if self.per_client[host] >= self.limits.max_connections_per_client:
            self.connections.discard(self)
            self.refuse(429, "per_client", f"too many connections from {host}: at most "
                        f"{self.limits.max_connections_per_client} at once", "rate_limit_exceeded")
            return
        if len(self.connections) > self.limits.max_connections and not self._evict_one():
            self.connections.discard(self)
            self.refuse(503, "overloaded", f"overloaded: {self.limits.max_connections} connections are "
                        "busy; retry shortly", "overloaded")
            return
        self._admitted = True
        self.per_client[host] += 1
        GATEWAY_OPEN_CONNECTIONS.inc()
        self.waiting[self] = None
        self._arm_header_timer()

    def _evict_one(self) -> bool:
        """Close the connection that has waited longest without a request; False if none."""
        while self.waiting:
            oldest, _ = self.waiting.popitem(last=False)
            if not oldest.transport.is_closing():
                GATEWAY_CONNECTIONS.labels("evicted").inc()
                oldest.connections.discard(oldest)
                oldest.transport.close()
                return True
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        self.waiting.pop(self, None)
        if self._admitted:
            self._admitted = False
            host = self.client[0] if self.client else "?"
            self.per_client[host] -= 1
            if self.per_client[host] <= 0:
                del self.per_client[host]
            GATEWAY_OPEN_CONNECTIONS.dec()
        super().connection_lost(exc)

    def refuse(self, status: int, reason: str, message: str, code: str | None = None) -> None:
        """Answer ``status`` (before or instead of any request), then close once the client
        has had :data:`LINGER_S` to read it."""
        if self._refused or self.transport.is_closing():
            return
        self._refused = True
        self.waiting.pop(self, None)
        self._cancel_header_timer()
        self._unset_keepalive_if_required()
        GATEWAY_CONNECTIONS.labels(reason).inc()
        GATEWAY_REQUESTS.labels("none", "none", str(status)).inc()
        headers = (("retry-after", "1"),) if status in (429, 503) else ()
        self.transport.write(error_bytes(status, message, code, headers))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)

    # ----------------------------------------------------------------- input
    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # read and dropped until the linger ends
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        head_limit = self.limits.max_request_line_bytes + self.limits.max_header_bytes
        if self._in_head and self._head_bytes > head_limit and not self._refused:
            self.refuse(431, "headers_too_large", f"request headers longer than {head_limit} bytes")

    def send_400_response(self, msg: str) -> None:
        """The parser refused the request (or a callback raised :class:`Refusal`)."""
        cause, self._refusal = self._refusal, None
        if cause is not None:
            self.refuse(cause.status, cause.reason, str(cause))
        else:
            self.refuse(400, "malformed", "malformed HTTP request: the request line, headers or "
                        "framing (Content-Length, Transfer-Encoding) are invalid")

    def _raise(self, refusal: Refusal) -> None:
        self._refusal = refusal  # the parser turns it into HttpParserCallbackError
        raise refusal

    # ----------------------------------------------------------------- parser callbacks
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.waiting.pop(self, None)
        self._in_head, self._began, self._headers_seen = True, True, 0
        if self._header_timer is None:
            self._arm_header_timer()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head, self._began, self._head_bytes = True, False, 0

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._admitted and not self.transport.is_closing() and not self._began:
            self.waiting[self] = None  # idle between requests: may be evicted

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        if len(self.url) > self.limits.max_request_line_bytes:
            self._raise(Refusal(414, "request_line_too_long",
                                f"request line longer than {self.limits.max_request_line_bytes} bytes"))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers_seen += 1
        if self._headers_seen > MAX_HEADERS:
            self._raise(Refusal(431, "headers_too_large", f"more than {MAX_HEADERS} request headers"))
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._cancel_header_timer()
        self._in_head = False
        size = sum(len(n) + len(v) + 4 for n, v in self.headers)
        if size > self.limits.max_header_bytes:
            self._raise(Refusal(431, "headers_too_large",
                                f"request headers longer than {self.limits.max_header_bytes} bytes"))
        version = self.parser.get_http_version()
        if version not in ("1.0", "1.1"):
            self._raise(Refusal(505, "http_version", f"HTTP/{version} is not supported; use HTTP/1.1"))
        super().on_headers_complete()
        self.cycle.transport = OnePass(self.transport, self.loop)  # type: ignore[assignment]

    def timeout_keep_alive_handler(self) -> None:
        """No new request within ``idle_timeout_s`` of the last answer."""
        if not self.transport.is_closing():
            GATEWAY_CONNECTIONS.labels("idle_timeout").inc()
        super().timeout_keep_alive_handler()

    # ----------------------------------------------------------------- header timeout
    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or not self._in_head:
            return
        if not self._began:  # silent: nothing to answer
            GATEWAY_CONNECTIONS.labels("header_timeout").inc()
            self.transport.close()
            return
        self.refuse(408, "header_timeout",
                    f"request headers not received within {self.limits.header_timeout_s:g} s")


__all__ = ["GuardedProtocol", "Refusal", "guarded_protocol", "httptools"]
