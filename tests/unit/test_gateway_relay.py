"""The asynchronous relay to an engine (services/gateway/asgi/relay.py), through the real
server: answers and errors as the blocking client gives them, a client that leaves closes the
engine's connection (a stream or a whole answer), a stream is read to its end so its
connection carries the next request, and each request reaches the engine once."""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import select
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from services.gateway.asgi.app import GatewayServer
from services.gateway.asgi.relay import AsyncEngineClient
from services.gateway.engine_backend import EngineBackend, EngineClient
from services.gateway.generation import GenRequest, UpstreamError
from tests.unit.test_gateway_backends import _RawEngine
from tests.unit.test_gateway_openai import AUTH, CHAT, events
from tests.unit.test_gateway_openai import make as make_openai
from tests.unit.test_gateway_server import connect, read_response


class SlowEngine(_RawEngine):
    """A raw HTTP/1.1 engine on loopback: a streamed request gets ``tokens`` events ``gap_s``
    apart, a whole one its answer after ``gap_s * tokens``. It notes when a client closes the
    connection before the answer is complete (``left``) and how many events it had sent."""

    def __init__(self, tokens: int = 40, gap_s: float = 0.05, status: int = 200) -> None:
        self.tokens, self.gap_s, self.status = tokens, gap_s, status
        self.break_after: int | None = None
        """Streams: close the connection after this many events, mid-answer."""
        self.gzip = False
        """Whole answers: compressed, whether asked for or not."""
        self.asked_to_compress = False
        self.sent = 0
        self.left = threading.Event()
        super().__init__(after_done=0)

    def _answer(self, conn: socket.socket, headers: list[bytes], body: bytes) -> bool:
        self.asked_to_compress |= any(h.startswith(b"accept-encoding:") for h in headers)
        try:
            answered = self._reply(conn, bool(json.loads(body).get("stream")))
        except OSError:
            answered = False
        if not answered:
            self.left.set()
        return answered

    def _gone(self, conn: socket.socket, wait_s: float) -> bool:
        """Wait up to ``wait_s``; True when the client closed the connection meanwhile."""
        readable, _, _ = select.select([conn], [], [], wait_s)
        return bool(readable) and conn.recv(1, socket.MSG_PEEK) == b""

    @staticmethod
    def event(i: int, final: bool) -> dict[str, Any]:
        return {"choices": [{"delta": {"content": f" t{i}"}, "token_ids": [i + 3], "prompt_token_ids": [1, 2],
                             "logprobs": {"content": [{"logprob": -0.5}]},
                             "finish_reason": "stop" if final else None}]}

    def _reply(self, conn: socket.socket, stream: bool) -> bool:
        """False when the client left before the answer was complete."""
        if self.status != 200:
            data = json.dumps({"error": {"message": "bad prompt"}}).encode()
            conn.sendall(b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                         % (self.status, len(data), data))
            return True
        if not stream:
            if self._gone(conn, self.gap_s * self.tokens):
                return False
            whole = {"choices": [{"message": {"content": "all"}, "token_ids": [3, 4],
                                  "prompt_token_ids": [1, 2], "finish_reason": "stop",
                                  "logprobs": {"content": [{"logprob": -0.5}, {"logprob": -0.5}]}}]}
            data = json.dumps(whole).encode()
            coding = b""
            if self.gzip:
                data, coding = gzip.compress(data), b"Content-Encoding: gzip\r\n"
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n%s"
                         b"Content-Length: %d\r\n\r\n%s" % (coding, len(data), data))
            return True
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        for i in range(self.tokens):
            if i and self._gone(conn, self.gap_s):
                return False
            if i == self.break_after:
                conn.shutdown(socket.SHUT_RDWR)  # the connection closes with the answer unfinished
                return True
            data = b"data: " + json.dumps(self.event(i, i == self.tokens - 1)).encode() + b"\n\n"
            conn.sendall(b"%x\r\n%s\r\n" % (len(data), data))
            self.sent += 1
        conn.sendall(b"f\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
        return True



def backend_on(url: str, timeout_s: float = 10.0) -> EngineBackend:
    relay = AsyncEngineClient(url, timeout_s=timeout_s)
    return EngineBackend(EngineClient(url, timeout_s=timeout_s), "base", relay)


@pytest.fixture
def engine() -> Iterator[SlowEngine]:
    eng = SlowEngine()
    yield eng
    eng.stop()


def serve(backend: EngineBackend) -> tuple[GatewayServer, list[dict[str, Any]], list[Any]]:
    gateway, logged, counts = make_openai(backend)  # type: ignore[arg-type]
    assert gateway.relays("POST", "/v1/chat/completions")
    return GatewayServer(gateway, "127.0.0.1", 0).start(), logged, counts


def raw_post(body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: {AUTH['Authorization']}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode() + data


def post(conn: http.client.HTTPConnection, body: dict[str, Any]) -> tuple[int, bytes]:
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(),
                 headers={**AUTH, "Content-Type": "application/json"})
    resp = conn.getresponse()
    return resp.status, resp.read()


def wait_for(cond: Any, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_whole_and_streamed_answers_are_relayed_and_logged(engine: SlowEngine) -> None:
    engine.tokens, engine.gap_s = 5, 0.0
    srv, logged, _ = serve(backend_on(engine.url))
    try:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
        code, body = post(conn, CHAT)
        assert code == 200 and json.loads(body)["choices"][0]["message"]["content"] == "all"
        code, body = post(conn, {**CHAT, "stream": True})
        datas = events(body)
        assert code == 200 and datas[-1] == "[DONE]" and len(datas) == 6
        conn.close()
        wait_for(lambda: len(logged) == 2, 3, "both answers logged")
        assert [e["completion_tokens"] for e in logged] == [[3, 4], [3, 4, 5, 6, 7]]
        assert engine.requests == 2 and engine.connections == 1  # the stream's connection was reused
    finally:
        srv.stop(drain_s=1.0)


def test_no_compression_is_asked_for_and_a_compressed_answer_is_read(engine: SlowEngine) -> None:
    engine.gap_s, engine.gzip = 0.0, True
    srv, _, _ = serve(backend_on(engine.url))
    try:
        code, body = post(http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10), CHAT)
        assert code == 200 and json.loads(body)["choices"][0]["message"]["content"] == "all"
        assert not engine.asked_to_compress
    finally:
        srv.stop(drain_s=1.0)


def test_an_answer_over_the_limit_is_502_not_held(engine: SlowEngine,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from services.gateway.asgi import relay

    monkeypatch.setattr(relay, "ANSWER_LIMIT", 100)  # the engine's whole answer is ~200 bytes
    engine.gap_s = 0.0
    srv, _, _ = serve(backend_on(engine.url))
    try:
        code, body = post(http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10), CHAT)
        assert code == 502 and "more than 100 bytes" in json.loads(body)["error"]["message"]
    finally:
        srv.stop(drain_s=1.0)


def test_a_client_leaving_a_stream_closes_the_engines_connection_and_logs_what_was_served(
        engine: SlowEngine) -> None:
    srv, logged, _ = serve(backend_on(engine.url))
    try:
        with connect(srv) as sock:
            sock.sendall(raw_post({**CHAT, "stream": True}))
            got = b""
            while got.count(b"data: ") < 3:
                got += sock.recv(65536)
        assert engine.left.wait(2), "the engine's connection stayed open after the client left"
        assert engine.sent < engine.tokens
        wait_for(lambda: logged, 3, "no exposure for the part that was served")
        [fields] = logged
        assert 3 <= len(fields["completion_tokens"]) <= engine.sent
    finally:
        srv.stop(drain_s=1.0)


def test_a_client_leaving_before_a_whole_answer_closes_the_engines_connection(engine: SlowEngine) -> None:
    engine.gap_s = 0.1  # 4 s to the answer
    srv, logged, counts = serve(backend_on(engine.url))
    try:
        with connect(srv) as sock:
            sock.sendall(raw_post(CHAT))
            wait_for(lambda: engine.requests == 1, 3, "the request reached the engine")
        t0 = time.monotonic()
        assert engine.left.wait(2), "the engine kept generating for a client that had left"
        assert time.monotonic() - t0 < 2 and not logged and not counts
    finally:
        srv.stop(drain_s=1.0)


@pytest.mark.parametrize(("url", "timeout_s", "code"), [
    ("unreachable", 5.0, 502), ("slow", 0.3, 504), ("refuses", 5.0, 400)])
def test_engine_failures_are_openai_errors(engine: SlowEngine, url: str, timeout_s: float, code: int) -> None:
    if url == "unreachable":
        spare = socket.create_server(("127.0.0.1", 0))
        target = f"http://127.0.0.1:{spare.getsockname()[1]}"
        spare.close()
    else:
        target = engine.url
        engine.status = 422 if url == "refuses" else 200
    srv, _, _ = serve(backend_on(target, timeout_s))
    try:
        with connect(srv) as sock:
            sock.sendall(raw_post(CHAT))
            status, _, body = read_response(sock)
        assert status == code, body
        assert set(json.loads(body)["error"]) >= {"message", "type", "code"}
    finally:
        srv.stop(drain_s=1.0)


def test_a_stream_that_breaks_ends_with_an_error_event_and_logs_what_was_served(engine: SlowEngine) -> None:
    engine.gap_s, engine.break_after = 0.05, 3
    srv, logged, _ = serve(backend_on(engine.url))
    try:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
        code, body = post(conn, {**CHAT, "stream": True})
        datas = events(body)
        assert code == 200 and len(datas) == 4 and "[DONE]" not in datas
        assert "error" in datas[-1] and "stream" in datas[-1]["error"]["message"]
        wait_for(lambda: logged, 3, "the part served before the break is logged")
        assert logged[0]["completion_tokens"] == [3, 4, 5]
    finally:
        srv.stop(drain_s=1.0)


@pytest.mark.parametrize("after_done", [0, 4096, -1], ids=["closing-chunk", "short-tail", "endless-tail"])
def test_the_relay_reads_a_stream_to_its_end_and_sends_each_request_once(after_done: int) -> None:
    raw = _RawEngine(after_done)
    relay = AsyncEngineClient(raw.url, timeout_s=5)
    req = GenRequest("chat", 4, 1.0, messages=({"role": "user", "content": "hi"},))

    async def three() -> None:
        for _ in range(3):
            t0 = time.monotonic()
            tokens = [t async for p in relay.pieces("base", req, stream=True) for t in p.tokens]
            assert tokens == [7] and time.monotonic() - t0 < 3.0
        await relay.aclose()

    try:
        asyncio.run(three())
        assert raw.requests == 3
        assert raw.connections == (3 if after_done < 0 else 1)
    finally:
        raw.stop()


def test_the_relay_refuses_a_bad_url_and_maps_a_refused_connection_to_502() -> None:
    with pytest.raises(ValueError, match="must be http"):
        AsyncEngineClient("ftp://engine")
    spare = socket.create_server(("127.0.0.1", 0))
    relay = AsyncEngineClient(f"http://127.0.0.1:{spare.getsockname()[1]}", timeout_s=2)
    spare.close()
    req = GenRequest("completion", 4, 1.0, prompt="hi")

    async def once() -> None:
        try:
            async for _ in relay.pieces("base", req, stream=False):
                pass
        finally:
            await relay.aclose()

    with pytest.raises(UpstreamError) as info:
        asyncio.run(once())
    assert info.value.status == 502 and "unreachable" in str(info.value)


def test_the_official_async_client_streams_200_at_once_through_the_relay() -> None:
    """As a client would: the official ``openai`` async client, 200 concurrent streams from one
    address (the per-client cap raised, as behind a proxy), each ending whole and logged once."""
    import openai

    from bench.fake_engine import FakeEngine
    from tests.unit.test_gateway_openai import KEY

    fake = FakeEngine(token_ms=5.0).start()
    gateway, logged, _ = make_openai(backend_on(fake.base_url), max_connections_per_client=1024)
    srv = GatewayServer(gateway, "127.0.0.1", 0).start()

    async def stream(client: openai.AsyncOpenAI, i: int) -> str:
        chunks = await client.chat.completions.create(
            model="rtrl-policy", messages=[{"role": "user", "content": f"hi {i}"}], user=f"u{i}",
            max_tokens=8, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key=KEY, max_retries=0,
                                    timeout=60)
        try:
            return await asyncio.gather(*(stream(client, i) for i in range(200)))
        finally:
            await client.close()

    try:
        texts = asyncio.run(run())
        assert all(t.count(" w") == 8 for t in texts), texts[:3]
        wait_for(lambda: len(logged) == 200, 5, "every stream logged")
        assert sorted(e["user_key"] for e in logged) == sorted(f"u{i}" for i in range(200))
        assert all(len(e["completion_tokens"]) == 8 for e in logged) and fake.posts == 200
    finally:
        srv.stop(drain_s=1.0)
        fake.stop()
