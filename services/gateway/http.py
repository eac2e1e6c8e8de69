"""The gateway's HTTP/1.1 transport: the standard library's server, hardened for production.

What it adds to ``http.server`` (docs/gateway.md, "HTTP server"):

* **a sized listen backlog** (``listen_backlog``; the kernel caps it at ``net.core.somaxconn``);
* **a bounded worker pool**: one reused thread per open connection, at most
  ``max_connections``; a connection beyond that is answered ``503`` JSON at once and closed,
  so an overloaded gateway says so instead of letting clients queue without limit;
* **two timeouts**: a connection that sends no new request for ``idle_timeout_s`` is closed
  silently (keep-alive or fresh); once the first byte of a request has arrived, its request
  line, headers and body must all arrive within ``read_timeout_s`` in total (a deadline, not a
  per-read timeout, so a client sending one byte a second is cut off too), else ``408``;
* **size limits**: request line ``max_request_line_bytes`` (``414``), header block
  ``max_header_bytes`` or more than 100 header lines (``431``);
* **every error JSON**: ``send_error`` is overridden, so 400, 408, 414, 431, 501, 503 and 505
  are ``{"error": "..."}`` with ``Content-Type: application/json``, never the stdlib's HTML.

Why threads and not asyncio: measured in docs/benchmarks.md ("Gateway under concurrency").
"""

from __future__ import annotations

import http.client
import io
import json
import logging
import queue
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any, ClassVar

from ingest.contracts.prometheus import GATEWAY_CONNECTIONS, GATEWAY_OPEN_CONNECTIONS, GATEWAY_REQUESTS
from services.settings.services import GatewaySettings

log = logging.getLogger(__name__)

LINGER_S = 1.0
"""After an error answer, unread input is drained for at most this long before the socket is
closed: closing with unread input sends a reset that can destroy the answer in flight."""


@dataclass(frozen=True)
class Response:
    code: int
    body: bytes
    content_type: str = "application/json"
    headers: tuple[tuple[str, str], ...] = ()
    stream: Iterator[bytes] | None = None
    """When set, the body is sent as these chunks (``Transfer-Encoding: chunked``), each
    written as soon as it is produced; ``body`` is ignored."""


def json_response(code: int, body: dict[str, Any]) -> Response:
    return Response(code, json.dumps(body, separators=(",", ":")).encode())


def error_response(code: int, message: str) -> Response:
    """The documented error body: ``{"error": "<message>"}``."""
    return json_response(code, {"error": message})


class DeadlineReader(io.RawIOBase):
    """The socket's input, raising ``TimeoutError`` once ``deadline`` (monotonic) has passed:
    each read waits at most for what is left, however little data each read brings."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.deadline = time.monotonic()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("read deadline passed")
        self._sock.settimeout(left)
        return self._sock.recv_into(buffer)


class HeaderBudget:
    """``readline`` over the request's input that fails with ``LineTooLong`` (-> 431) once the
    header block exceeds ``limit`` bytes in total (the stdlib only limits each line to 64 KiB)."""

    def __init__(self, rfile: io.BufferedIOBase, limit: int) -> None:
        self._rfile = rfile
        self._limit = limit
        self._left = limit

    def readline(self, size: int = -1) -> bytes:
        cap = self._left + 1 if size < 0 else min(size, self._left + 1)
        line = self._rfile.readline(cap)
        self._left -= len(line)
        if self._left < 0:
            raise http.client.LineTooLong(f"request headers longer than {self._limit} bytes")
        return line


class JsonRequestHandler(BaseHTTPRequestHandler):
    """HTTP/1.1 keep-alive handler with the limits and timeouts of ``settings`` and JSON errors.
    Subclasses define ``do_<METHOD>``; they read the body with :meth:`read_body` and answer with
    :meth:`respond`."""

    settings: ClassVar[GatewaySettings]
    protocol_version = "HTTP/1.1"  # keep-alive: clients reuse one connection
    disable_nagle_algorithm = True  # small responses go out at once

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # replaced by one that keeps the read deadline
        self._reader = DeadlineReader(self.connection)
        self._input = io.BufferedReader(self._reader)
        self.rfile = self._input
        self._linger = False

    def handle_one_request(self) -> None:
        self.close_connection = True
        if not self._await_request():
            return
        self._reader.deadline = time.monotonic() + self.settings.read_timeout_s
        self.requestline, self.request_version, self.command = "", "HTTP/1.1", ""
        try:
            if self._read_head():
                self._call_method()
        except TimeoutError:
            GATEWAY_CONNECTIONS.labels("read_timeout").inc()
            self.send_error(HTTPStatus.REQUEST_TIMEOUT,
                            f"request not received within {self.settings.read_timeout_s:g} s")
        except OSError:  # reset or broken pipe: nothing to answer
            self.close_connection = True

    def _await_request(self) -> bool:
        """Wait up to ``idle_timeout_s`` for the first byte of the next request."""
        self._reader.deadline = time.monotonic() + self.settings.idle_timeout_s
        try:
            return bool(self._input.peek(1))
        except TimeoutError:
            GATEWAY_CONNECTIONS.labels("idle_timeout").inc()
            return False
        except OSError:
            return False

    def _read_head(self) -> bool:
        """Request line and headers; False (the error answered) when they are refused."""
        limit = self.settings.max_request_line_bytes
        line = self.rfile.readline(limit + 1)
        if len(line) > limit:
            self.send_error(HTTPStatus.REQUEST_URI_TOO_LONG, f"request line longer than {limit} bytes")
            return False
        self.raw_requestline = line
        return self.parse_request()

    def parse_request(self) -> bool:
        if len(self.raw_requestline.split()) == 2:  # "GET /": HTTP/0.9, which has no headers
            self.send_error(HTTPStatus.HTTP_VERSION_NOT_SUPPORTED, "HTTP/0.9 is not supported; use HTTP/1.1")
            return False
        rfile = self.rfile
        self.rfile = HeaderBudget(rfile, self.settings.max_header_bytes)  # type: ignore[assignment]
        try:
            ok = super().parse_request()
        finally:
            self.rfile = rfile
        return ok

    def _call_method(self) -> None:
        method = getattr(self, "do_" + self.command, None)
        if method is None:
            self.send_error(HTTPStatus.NOT_IMPLEMENTED,
                            f"unsupported method {self.command[:32]!r}; the API uses GET and POST")
            return
        method()
        self.wfile.flush()

    def read_body(self, length: int) -> bytes:
        """The body, within the request's read deadline (``TimeoutError`` -> 408)."""
        return self.rfile.read(length) if length > 0 else b""

    def respond(self, resp: Response) -> None:
        self.connection.settimeout(self.settings.read_timeout_s)  # a client that never reads
        self.send_response(resp.code)
        self.send_header("Content-Type", resp.content_type)
        for name, value in resp.headers:
            self.send_header(name, value)
        if resp.stream is not None:
            self._respond_stream(resp.stream)
            return
        self.send_header("Content-Length", str(len(resp.body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        # headers and body in one write: no Nagle/delayed-ACK stall on the client
        buffer: list[bytes] = self._headers_buffer  # type: ignore[attr-defined]
        buffer += [b"\r\n", resp.body]
        self.flush_headers()

    def _respond_stream(self, chunks: Iterator[bytes]) -> None:
        """Chunked transfer: each chunk is written and flushed as it comes. A client that goes
        away ends the stream (the iterator is closed, so it can clean up) and the connection."""
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Cache-Control", "no-cache")
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        try:
            for data in chunks:
                if data:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                    self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except OSError:
            self.close_connection = True
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """Every error the transport produces, as the documented JSON body; closes the connection."""
        if self.request_version == "HTTP/0.9":  # the stdlib writes no status line for 0.9
            self.request_version = "HTTP/1.1"
        self.close_connection = True
        self._linger = True
        GATEWAY_REQUESTS.labels("none", "none", str(int(code))).inc()
        text = message or HTTPStatus(code).phrase
        self.respond(error_response(int(code), text[:300]))

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            if self._linger:
                linger(self.connection, LINGER_S)

    def log_message(self, format: str, *args: object) -> None:
        return  # per-request logs would cost latency; metrics count requests


def linger(sock: socket.socket, seconds: float) -> None:
    """Half-close, then read and discard input until the peer closes or ``seconds`` pass."""
    deadline = time.monotonic() + seconds
    try:
        sock.shutdown(socket.SHUT_WR)
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            if not sock.recv(65536):
                return
    except OSError:
        return


class WorkerPool:
    """At most ``size`` threads, started on demand and reused; ``submit`` refuses (False) when
    all of them are busy instead of queueing."""

    def __init__(self, size: int, work: Callable[[Any], None], name: str = "http") -> None:
        self.size = size
        self.busy = 0
        self._idle = 0
        self._started = 0
        self._work = work
        self._name = name
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()

    def submit(self, job: Any) -> bool:
        with self._lock:
            if self.busy >= self.size:
                return False
            self.busy += 1
            if self._idle:
                self._idle -= 1
            else:
                self._started += 1
                threading.Thread(target=self._run, name=f"{self._name}-{self._started}", daemon=True).start()
        self._jobs.put(job)
        return True

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                self._work(job)
            except Exception:
                log.exception("worker failed")
            finally:
                with self._lock:
                    self.busy -= 1
                    self._idle += 1


class PooledHTTPServer(HTTPServer):
    """``HTTPServer`` with a listen backlog of ``settings.listen_backlog`` and connections served
    by a :class:`WorkerPool` of ``settings.max_connections``; beyond it, 503 at once."""

    def __init__(self, address: tuple[str, int], handler: type[JsonRequestHandler],
                 settings: GatewaySettings) -> None:
        self.request_queue_size = settings.listen_backlog
        self._pool = WorkerPool(settings.max_connections, self._serve)
        self._open: set[socket.socket] = set()
        self._refused: deque[tuple[float, socket.socket]] = deque()
        self._lock = threading.Lock()
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            self._open.add(request)
        if not self._pool.submit((request, client_address)):
            with self._lock:
                self._open.discard(request)
            self._refuse(request)

    def _serve(self, job: tuple[socket.socket, Any]) -> None:
        request, client_address = job
        GATEWAY_OPEN_CONNECTIONS.inc()
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            GATEWAY_OPEN_CONNECTIONS.dec()
            with self._lock:
                self._open.discard(request)
            self.shutdown_request(request)

    def _refuse(self, request: socket.socket) -> None:
        """503 without waiting for the request (the accept loop must not block); the socket is
        closed by :meth:`service_actions` a moment later, once its input has been drained."""
        GATEWAY_CONNECTIONS.labels("rejected").inc()
        GATEWAY_REQUESTS.labels("none", "none", "503").inc()
        body = error_response(503, f"overloaded: {self._pool.size} connections open; retry shortly").body
        head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n")
        try:
            request.setblocking(False)
            request.send(head.encode() + body)
            request.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        self._refused.append((time.monotonic() + LINGER_S, request))
        while len(self._refused) > self._pool.size:
            self._close_refused(self._refused.popleft()[1])

    def service_actions(self) -> None:
        """Called by ``serve_forever`` between accepts: close refused sockets whose time is up."""
        now = time.monotonic()
        while self._refused and self._refused[0][0] <= now:
            self._close_refused(self._refused.popleft()[1])

    @staticmethod
    def _close_refused(request: socket.socket) -> None:
        try:
            while request.recv(65536):  # non-blocking: drain what arrived, then close
                pass
        except OSError:
            pass
        request.close()

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.exception("error serving a connection from %s", client_address)

    def close_connections(self) -> None:
        """Close every open connection (idle keep-alive ones included) and refused socket."""
        with self._lock:
            open_now = list(self._open)
        for sock in open_now:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        while self._refused:
            self._close_refused(self._refused.popleft()[1])
