"""A whole answer leaves the gateway in one write, and its bookkeeping waits until it has
left (services/gateway/asgi/protocol.py ``OnePass``, ``Response.after``)."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

import pytest

from services.gateway.asgi.app import GatewayServer
from services.gateway.asgi.protocol import GuardedProtocol, OnePass
from tests.unit.test_gateway_openai import AUTH, CHAT, StreamBackend, make
from tests.unit.test_gateway_server import POST, connect, read_response, start

pytestmark = pytest.mark.unit


class Recorder:
    """A transport that notes every call made on it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bytes]] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.calls.append(("write", data))

    def close(self) -> None:
        self.calls.append(("close", b""))
        self.closing = True

    def write_eof(self) -> None:
        self.calls.append(("eof", b""))

    def is_closing(self) -> bool:
        return self.closing

    def get_extra_info(self, name: str) -> Any:
        return f"info:{name}"


def passes(fn: Any) -> list[tuple[str, bytes]]:
    """Run ``fn(onepass, transport)`` on a fresh loop, let the loop finish its passes, and
    return what reached the transport."""
    transport = Recorder()

    async def main() -> None:
        await fn(OnePass(transport, asyncio.get_running_loop()), transport)  # type: ignore[arg-type]
        await asyncio.sleep(0)
        await asyncio.sleep(0)

    asyncio.run(main())
    return transport.calls


def test_writes_within_one_pass_leave_as_one() -> None:
    async def fn(t: OnePass, raw: Recorder) -> None:
        t.write(b"HTTP/1.1 200 OK\r\n\r\n")
        t.write(b"body")
        assert raw.calls == []  # held until the loop's next pass

    assert passes(fn) == [("write", b"HTTP/1.1 200 OK\r\n\r\nbody")]


def test_writelines_keeps_its_place_among_the_held_writes() -> None:
    async def fn(t: OnePass, _raw: Recorder) -> None:
        t.write(b"a")
        t.writelines([b"b", b"c"])
        t.write(b"d")

    assert passes(fn) == [("write", b"abcd")]


def test_writes_in_later_passes_are_not_held_back() -> None:
    async def fn(t: OnePass, raw: Recorder) -> None:
        t.write(b"head")
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert raw.calls == [("write", b"head")]
        t.write(b"chunk")

    assert passes(fn) == [("write", b"head"), ("write", b"chunk")]


def test_close_and_eof_send_what_is_held_first() -> None:
    async def close(t: OnePass, _raw: Recorder) -> None:
        t.write(b"answer")
        t.close()

    async def eof(t: OnePass, _raw: Recorder) -> None:
        t.write(b"answer")
        t.write_eof()

    assert passes(close) == [("write", b"answer"), ("close", b"")]
    assert passes(eof) == [("write", b"answer"), ("eof", b"")]


def test_nothing_is_written_to_a_closing_transport_and_other_calls_pass_through() -> None:
    async def fn(t: OnePass, raw: Recorder) -> None:
        t.write(b"late")
        raw.closing = True
        assert t.is_closing() and t.get_extra_info("peername") == "info:peername"

    assert passes(fn) == []


class Spy:
    """A served connection's transport, noting each write on its way to the socket."""

    def __init__(self, transport: Any) -> None:
        self._transport = transport
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))
        self._transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def test_each_whole_answer_is_one_write_on_the_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through uvicorn's own response cycle: head and body of each answer reach the socket in
    one write, so a client is never woken for a head whose body is still to come."""
    spies: list[Spy] = []
    made = GuardedProtocol.connection_made

    def spied(self: GuardedProtocol, transport: Any) -> None:
        spies.append(spy := Spy(transport))
        made(self, spy)  # type: ignore[arg-type]

    monkeypatch.setattr(GuardedProtocol, "connection_made", spied)
    srv = start()
    try:
        with connect(srv) as sock:
            for _ in range(5):
                sock.sendall(POST)
                assert read_response(sock)[0] == 200
    finally:
        srv.stop(drain_s=1.0)
    [spy] = spies
    assert len(spy.writes) == 5, [w[:40] for w in spy.writes]
    for write in spy.writes:
        head, _, body = write.partition(b"\r\n\r\n")
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        assert head.startswith(b"HTTP/1.1 200") and len(body) == length and json.loads(body)


def test_the_served_count_is_made_once_the_answer_is_out() -> None:
    gw, logged, counts = make(StreamBackend())
    raw = json.dumps({**CHAT, "request_id": "r-9"}).encode()
    deferred = gw.handle("POST", "/v1/chat/completions", raw, None, AUTH, defer=True)
    assert deferred.code == 200 and len(logged) == 1  # the exposure is never deferred
    assert counts == [] and deferred.after is not None
    deferred.after()
    assert counts == [("1", "stable", False)]
    now = gw.handle("POST", "/v1/chat/completions", raw.replace(b"r-9", b"r-10"), None, AUTH)
    assert now.after is None and counts == [("1", "stable", False)] * 2  # run before returning

    srv = GatewayServer(gw, "127.0.0.1", 0).start()
    try:
        body = raw.replace(b"r-9", b"r-11")
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: "
                         + AUTH["Authorization"].encode() + b"\r\nContent-Type: application/json\r\n"
                         + b"Content-Length: %d\r\n\r\n" % len(body) + body)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        deadline = time.monotonic() + 5
        while len(counts) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert counts == [("1", "stable", False)] * 3  # the server ran it after answering
    finally:
        srv.stop(drain_s=1.0)
