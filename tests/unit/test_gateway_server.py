"""The gateway's HTTP server against raw sockets on loopback, as a hostile or broken client
would call it: malformed framing is refused with 400 and the connection closed (never read as
a second request), errors are OpenAI's error object, slow, silent and idle clients are cut off
without holding the server, the connection caps answer at once, many keep-alive clients are
all served. The server runs in-process with a fake backend (no Redis, Kafka or MLflow)."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from ingest.contracts.prometheus import GATEWAY_CONNECTIONS
from services.gateway.asgi.app import GatewayServer
from tests.unit.test_gateway_core import REQ, FakeBackend, make

BODY = json.dumps(REQ).encode()
POST = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(BODY)) + BODY


def start(**settings: Any) -> GatewayServer:
    gateway, _logged = make(FakeBackend([5, 6, 1]), **{"read_timeout_s": 1.0, "idle_timeout_s": 1.0,
                                                        "header_timeout_s": 1.0, **settings})
    return GatewayServer(gateway, "127.0.0.1", 0).start()


@pytest.fixture
def server() -> Iterator[GatewayServer]:
    srv = start()
    yield srv
    srv.stop(drain_s=1.0)


def connect(srv: GatewayServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
    return sock


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One response: (status, headers lower-cased, body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, rest = data.split(b"\r\n\r\n", 1)
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    length = int(headers["content-length"])
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk
        rest += chunk
    return int(status_line.split()[1]), headers, rest[:length]


def exchange(srv: GatewayServer, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    with connect(srv) as sock:
        sock.sendall(raw)
        return read_response(sock)


def assert_json_error(resp: tuple[int, dict[str, str], bytes], code: int) -> str:
    status, headers, body = resp
    assert status == code, body
    assert headers["content-type"] == "application/json"
    payload = json.loads(body)
    assert set(payload) == {"error"} and set(payload["error"]) == {"message", "type", "param", "code"}
    assert payload["error"]["message"] and payload["error"]["type"]
    return str(payload["error"]["message"])


def assert_served_again_within(srv: GatewayServer, seconds: float) -> None:
    """A new client gets 200 within ``seconds`` (a freed slot is seen asynchronously)."""
    deadline = time.monotonic() + seconds
    while exchange(srv, POST)[0] != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_keep_alive_serves_several_requests_on_one_connection(server: GatewayServer) -> None:
    with connect(server) as sock:
        for _ in range(3):
            sock.sendall(POST)
            status, headers, body = read_response(sock)
            assert status == 200 and json.loads(body)["completion_tokens"] == [5, 6, 1]
            assert "connection" not in headers


@pytest.mark.parametrize("raw", [b"GARBAGE\r\n\r\n", b"GET / HTTP/1.1 extra\r\n\r\n",
                                 b"GET / HTTP/one\r\n\r\n", b"BREW / HTTP/1.1\r\nHost: x\r\n\r\n"])
def test_garbage_request_line_is_400_json(server: GatewayServer, raw: bytes) -> None:
    assert_json_error(exchange(server, raw), 400)


def test_long_request_line_is_414_json(server: GatewayServer) -> None:
    raw = b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"
    assert "request line" in assert_json_error(exchange(server, raw), 414)


def test_too_many_headers_is_431_json(server: GatewayServer) -> None:
    headers = b"".join(b"X-H%d: v\r\n" % i for i in range(200))
    assert_json_error(exchange(server, b"GET /healthz HTTP/1.1\r\n" + headers + b"\r\n"), 431)


def test_large_header_is_431_json(server: GatewayServer) -> None:
    raw = b"GET /healthz HTTP/1.1\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n"
    assert_json_error(exchange(server, raw), 431)


def test_header_block_over_the_limit_is_431_json(server: GatewayServer) -> None:
    headers = b"".join(b"X-H%d: %s\r\n" % (i, b"b" * 500) for i in range(40))  # 40 x 500 B > 16 KiB
    assert_json_error(exchange(server, b"GET /healthz HTTP/1.1\r\n" + headers + b"\r\n"), 431)


def test_a_known_method_the_api_does_not_use_is_405_json(server: GatewayServer) -> None:
    _, headers, _ = resp = exchange(server, b"PROPFIND /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
    assert_json_error(resp, 405)
    assert headers["allow"] == "GET"


@pytest.mark.parametrize("raw", [b"GET / HTTP/2.0\r\nHost: x\r\n\r\n", b"GET /\r\n\r\n"])
def test_unsupported_http_version_is_505_json(server: GatewayServer, raw: bytes) -> None:
    assert_json_error(exchange(server, raw), 505)


def test_api_errors_are_unchanged(server: GatewayServer) -> None:
    assert_json_error(exchange(server, b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n"), 404)
    assert_json_error(exchange(server, b"GET /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n"), 405)
    big = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 999999\r\n\r\n"
    assert_json_error(exchange(server, big), 413)


def test_slow_client_is_cut_off_and_does_not_block_others(server: GatewayServer) -> None:
    before = GATEWAY_CONNECTIONS.labels("header_timeout")._value.get()
    slow = connect(server)
    stop = threading.Event()

    def trickle() -> None:
        for byte in POST:
            if stop.is_set():
                return
            try:
                slow.send(bytes([byte]))
            except OSError:
                return
            time.sleep(0.5)

    t0 = time.monotonic()
    threading.Thread(target=trickle, daemon=True).start()
    status, _headers, _body = exchange(server, POST)  # another client meanwhile
    assert status == 200 and time.monotonic() - t0 < 0.5
    try:
        assert_json_error(read_response(slow), 408)
        assert closed_by_server(slow)
        assert time.monotonic() - t0 < 2.5
    finally:
        stop.set()
        slow.close()
    assert GATEWAY_CONNECTIONS.labels("header_timeout")._value.get() == before + 1


def test_slow_body_is_cut_off_with_408(server: GatewayServer) -> None:
    with connect(server) as sock:
        sock.sendall(POST[:-5])  # headers and most of the body; the rest never comes
        t0 = time.monotonic()
        assert_json_error(read_response(sock), 408)
        assert time.monotonic() - t0 < 2.0


def test_idle_keep_alive_connection_is_closed_after_the_idle_timeout(server: GatewayServer) -> None:
    before = GATEWAY_CONNECTIONS.labels("idle_timeout")._value.get()
    with connect(server) as sock:
        sock.sendall(POST)
        assert read_response(sock)[0] == 200
        t0 = time.monotonic()
        assert closed_by_server(sock)  # recv returns once the server closes
        assert 0.8 < time.monotonic() - t0 < 2.0
    assert GATEWAY_CONNECTIONS.labels("idle_timeout")._value.get() == before + 1


def test_a_full_server_evicts_the_longest_waiting_idle_connection() -> None:
    srv = start(max_connections=2, idle_timeout_s=5.0, header_timeout_s=5.0)
    before = GATEWAY_CONNECTIONS.labels("evicted")._value.get()
    silent = connect(srv)  # waits longest: never sends anything
    time.sleep(0.1)
    idle = connect(srv)
    try:
        idle.sendall(POST)
        assert read_response(idle)[0] == 200  # now idle between keep-alive requests
        assert exchange(srv, POST)[0] == 200  # a third client is served: the silent one made room
        assert closed_by_server(silent)
        assert GATEWAY_CONNECTIONS.labels("evicted")._value.get() == before + 1
    finally:
        silent.close()
        idle.close()
        srv.stop(drain_s=1.0)


def test_connections_beyond_max_connections_all_busy_get_503_json() -> None:
    srv = start(max_connections=2, idle_timeout_s=5.0, header_timeout_s=5.0)
    busy = [connect(srv), connect(srv)]
    try:
        for sock in busy:  # each has begun a request: none may be evicted
            sock.sendall(POST[:20])
        time.sleep(0.2)
        status, headers, body = exchange(srv, POST)
        assert_json_error((status, headers, body), 503)
        assert headers["connection"] == "close" and headers["retry-after"] == "1"
        busy.pop().close()
        assert_served_again_within(srv, 2.0)  # the closed connection's slot is free again
    finally:
        for sock in busy:
            sock.close()
        srv.stop(drain_s=1.0)


def listen_overflows() -> int | None:
    """The kernel's count of connections dropped because a listen queue was full
    (``TcpExt: ListenOverflows + ListenDrops``; None where /proc/net/netstat is absent)."""
    try:
        lines = open("/proc/net/netstat").read().splitlines()
    except OSError:
        return None
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:"):
            row = dict(zip(names.split()[1:], values.split()[1:], strict=False))
            return int(row.get("ListenOverflows", 0)) + int(row.get("ListenDrops", 0))
    return None


def test_200_concurrent_keep_alive_clients_are_all_answered() -> None:
    srv = start(idle_timeout_s=10.0, max_connections_per_client=1024)
    overflows_before = listen_overflows()
    n, rounds = 200, 3
    answered: list[float] = []
    failures: list[BaseException] = []
    go = threading.Barrier(n)

    def client() -> None:
        try:
            go.wait()  # all connect at once: a burst the listen backlog must absorb
            t0 = time.monotonic()
            with connect(srv) as sock:
                for _ in range(rounds):
                    sock.sendall(POST)
                    assert read_response(sock)[0] == 200
            answered.append(time.monotonic() - t0)
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(n)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=20)
        assert not failures, failures[:3]
        assert len(answered) == n
        # the burst fits the listen backlog: the kernel dropped no connection (a dropped one
        # would be retried after a SYN retransmit, 1 s and more). This is the property, not the
        # clients' wall time, which on a loaded machine is the scheduler's
        if overflows_before is not None:
            assert listen_overflows() == overflows_before, sorted(answered)[-5:]
        assert max(answered) < 10.0, sorted(answered)[-5:]
    finally:
        srv.stop(drain_s=1.0)


SMUGGLED = b"GET /v1/routing HTTP/1.1\r\nHost: x\r\n\r\n"
FRAMING = {
    "two_content_lengths": b"Content-Length: 3\r\nContent-Length: 5\r\n\r\nabcde",
    "same_content_length_twice": b"Content-Length: 5\r\nContent-Length: 5\r\n\r\nabcde",
    "negative_content_length": b"Content-Length: -5\r\n\r\n" + SMUGGLED,
    "non_numeric_content_length": b"Content-Length: 3a\r\n\r\nabc",
    "content_length_list": b"Content-Length: 3, 3\r\n\r\nabc",
    "chunked_and_content_length": b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
                                  + SMUGGLED,
    "chunked_not_last": b"Transfer-Encoding: chunked, gzip\r\n\r\n0\r\n\r\n" + SMUGGLED,
    "obsolete_line_folding": b"X-A: a\r\n  folded\r\nContent-Length: 0\r\n\r\n" + SMUGGLED,
    "space_before_colon": b"Content-Length : 0\r\n\r\n" + SMUGGLED,
    "bare_lf": b"Content-Length: 0\n\n" + SMUGGLED,
    "bad_chunk_size": b"Transfer-Encoding: chunked\r\n\r\nzz\r\nab\r\n0\r\n\r\n" + SMUGGLED,
}


@pytest.mark.parametrize("name", sorted(FRAMING))
def test_ambiguous_framing_is_400_and_closes_without_a_second_request(server: GatewayServer,
                                                                     name: str) -> None:
    raw = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + FRAMING[name]
    with connect(server) as sock:
        sock.sendall(raw)
        assert_json_error(read_response(sock), 400)
        rest = b""
        try:
            while chunk := sock.recv(65536):
                rest += chunk
        except ConnectionResetError:
            pass
        assert rest == b"", f"a second answer after the refusal: {rest[:200]!r}"


def test_chunked_body_is_read_whole(server: GatewayServer) -> None:
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(BODY[i:i + 7]), BODY[i:i + 7]) for i in range(0, len(BODY), 7))
    raw = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
           + chunked + b"0\r\n\r\n")
    status, _, body = exchange(server, raw)
    assert status == 200 and json.loads(body)["completion_tokens"] == [5, 6, 1]


def test_chunked_body_over_the_limit_is_413() -> None:
    srv = start(max_body_bytes=1024)
    try:
        chunk = b"a" * 600
        raw = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
               + (b"%x\r\n%s\r\n" % (len(chunk), chunk)) * 2 + b"0\r\n\r\n")
        assert "exceeds" in assert_json_error(exchange(srv, raw), 413)
    finally:
        srv.stop(drain_s=1.0)


def test_a_transfer_coding_the_gateway_cannot_decode_is_501(server: GatewayServer) -> None:
    raw = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
           b"3\r\nabc\r\n0\r\n\r\n")
    assert "transfer coding" in assert_json_error(exchange(server, raw), 501)


def test_repeated_authorization_header_is_400(server: GatewayServer) -> None:
    raw = POST.replace(b"Host: x\r\n", b"Host: x\r\nAuthorization: Bearer a\r\nAuthorization: Bearer b\r\n")
    assert "authorization" in assert_json_error(exchange(server, raw), 400)


def test_a_silent_new_connection_is_closed_after_the_header_timeout(server: GatewayServer) -> None:
    before = GATEWAY_CONNECTIONS.labels("header_timeout")._value.get()
    with connect(server) as sock:
        t0 = time.monotonic()
        assert closed_by_server(sock)  # nothing was sent: closed without an answer
        assert 0.8 < time.monotonic() - t0 < 2.5
    assert GATEWAY_CONNECTIONS.labels("header_timeout")._value.get() == before + 1


def test_connections_beyond_the_per_client_cap_get_429_and_others_are_served() -> None:
    srv = start(max_connections_per_client=2, idle_timeout_s=5.0, header_timeout_s=5.0)
    held = [connect(srv), connect(srv)]
    try:
        status, headers, body = exchange(srv, POST)
        assert_json_error((status, headers, body), 429)
        assert json.loads(body)["error"]["code"] == "rate_limit_exceeded" and headers["retry-after"] == "1"
        for sock in held:  # the held ones are served
            sock.sendall(POST)
            assert read_response(sock)[0] == 200
        held.pop().close()
        assert_served_again_within(srv, 2.0)  # a slot is free again once the close is seen
    finally:
        for sock in held:
            sock.close()
        srv.stop(drain_s=1.0)


def test_authentication_comes_before_any_other_check_on_v1() -> None:
    from pydantic import SecretStr

    srv = start(api_keys={"team": SecretStr("k" * 24)}, allow_anonymous=False)
    try:
        for raw in (POST.replace(b"application/json", b"text/plain"),
                    b"GET /v1/nope HTTP/1.1\r\nHost: x\r\n\r\n",
                    b"DELETE /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n"):
            status, headers, body = exchange(srv, raw)
            assert_json_error((status, headers, body), 401)
            assert headers["www-authenticate"].startswith("Bearer")
            assert json.loads(body)["error"]["code"] == "invalid_api_key"
            assert (headers.get("connection") == "close") == raw.startswith(b"POST")  # body unread
    finally:
        srv.stop(drain_s=1.0)


def test_answers_do_not_wait_for_the_clients_delayed_ack(server: GatewayServer) -> None:
    """Headers and body go out in two writes: without TCP_NODELAY on the accepted socket the
    second waits for the client's delayed ACK, a fixed ~40 ms on Linux loopback."""
    waits = []
    with connect(server) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(21):
            t0 = time.perf_counter()
            sock.sendall(POST)
            assert read_response(sock)[0] == 200
            waits.append(time.perf_counter() - t0)
    assert sorted(waits)[10] < 0.030, sorted(waits)


class SlowStream:
    """Streams up to 50 one-token pieces 20 ms apart; records whether its stream was closed."""

    vocab_size = None

    def __init__(self) -> None:
        self.closed = threading.Event()
        self.sent = 0

    def stream(self, req: Any, stream: bool = True) -> Iterator[Any]:
        from services.gateway.generation import Piece

        try:
            for i in range(50):
                self.sent += 1
                yield Piece(text="x", tokens=[i + 1], logprobs=[-0.1], prompt_tokens=[1, 2],
                            finish_reason="stop" if i == 49 else None)
                time.sleep(0.02)
        except GeneratorExit:
            self.closed.set()
            raise

    def close(self) -> None:
        pass


def test_a_client_leaving_a_stream_closes_the_engine_stream_and_logs_what_was_served() -> None:
    from tests.unit.test_gateway_openai import AUTH, CHAT
    from tests.unit.test_gateway_openai import make as make_openai

    backend = SlowStream()
    gateway, logged, _ = make_openai(backend)  # type: ignore[arg-type]
    srv = GatewayServer(gateway, "127.0.0.1", 0).start()
    try:
        body = json.dumps({**CHAT, "stream": True}).encode()
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: {AUTH['Authorization']}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        with connect(srv) as sock:
            sock.sendall(head + body)
            got = b""
            while b"data: " not in got:
                got += sock.recv(65536)
            assert got.startswith(b"HTTP/1.1 200")
        assert backend.closed.wait(3), "the engine's stream was not closed after the client left"
        deadline = time.monotonic() + 3
        while not logged:
            assert time.monotonic() < deadline, "no exposure for the part that was served"
            time.sleep(0.01)
        [fields] = logged
        assert 1 <= len(fields["completion_tokens"]) < 50 and backend.sent < 50
    finally:
        srv.stop(drain_s=1.0)


class ThreadRecordingStream:
    """Streams 10 pieces 5 ms apart and records the thread each piece was produced on."""

    vocab_size = None

    def __init__(self) -> None:
        self.threads: list[set[int]] = []

    def stream(self, req: Any, stream: bool = True) -> Iterator[Any]:
        from services.gateway.generation import Piece

        seen: set[int] = set()
        self.threads.append(seen)
        for i in range(10):
            seen.add(threading.get_ident())
            yield Piece(text="x", tokens=[i + 1], logprobs=[-0.1], prompt_tokens=[1, 2],
                        finish_reason="stop" if i == 9 else None)
            time.sleep(0.005)

    def close(self) -> None:
        pass


def test_each_stream_runs_in_one_thread_from_its_first_piece_to_its_last() -> None:
    """An engine backend keeps one HTTP connection per thread: a stream resumed on another
    thread would share its connection with that thread's next request and be cut short."""
    from tests.unit.test_gateway_openai import AUTH, CHAT
    from tests.unit.test_gateway_openai import make as make_openai

    backend = ThreadRecordingStream()
    gateway, logged, _ = make_openai(backend)  # type: ignore[arg-type]
    srv = GatewayServer(gateway, "127.0.0.1", 0).start()
    body = json.dumps({**CHAT, "stream": True}).encode()
    failures: list[BaseException] = []

    def client() -> None:
        try:
            for _ in range(3):
                conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
                conn.request("POST", "/v1/chat/completions", body=body,
                             headers={**AUTH, "Content-Type": "application/json"})
                text = conn.getresponse().read()
                assert text.count(b"data: ") == 11 and text.endswith(b"data: [DONE]\n\n"), text[-200:]
                conn.close()
        except BaseException as exc:
            failures.append(exc)

    try:
        threads = [threading.Thread(target=client) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not failures, failures[:2]
        assert len(backend.threads) == 24 and all(len(seen) == 1 for seen in backend.threads), backend.threads
        assert len(logged) == 24 and all(len(e["completion_tokens"]) == 10 for e in logged)
    finally:
        srv.stop(drain_s=1.0)
