"""The relay's own HTTP/1.1 client (services/gateway/asgi/engine_http.py) against a scripted
engine on a real loopback socket: every framing, encodings and their limits, malformed and
hostile answers, keep-alive reuse and its races, the connection limit, back-pressure."""

from __future__ import annotations

import asyncio
import gzip
import json
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from services.gateway.asgi import engine_http
from services.gateway.asgi.engine_http import EngineHTTPError, Pool
from services.gateway.asgi.relay import AsyncEngineClient
from services.gateway.generation import GenRequest, UpstreamError

Answer = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[bool]]
"""Reads one request from the stream and answers it; False closes the connection."""


class Scripted:
    """A loopback server answering each request with ``answer``; it counts connections,
    requests read and the most connections open at once."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.connections = self.requests = self.open = self.most_open = 0
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> Scripted:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                await reader.readexactly(length)
                self.requests += 1
                if not await self.answer(reader, writer, self.requests):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.open -= 1
            writer.close()


def reply(raw: bytes, keep: bool = True, wait_s: float = 0.0) -> Answer:
    async def answer(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _n: int) -> bool:
        if wait_s:
            await asyncio.sleep(wait_s)
        w.write(raw)
        await w.drain()
        return keep
    return answer


async def fetch(url: str, timeout_s: float = 5.0) -> tuple[int, dict[str, str], bytes]:
    pool = Pool(url, {"Content-Type": "application/json"}, timeout_s, 8)
    conn, _ = await pool.take()
    try:
        conn.send(pool.request("/v1/x", b"{}"))
        await conn.head()
        body = b""
        while chunk := await conn.chunk():
            body += chunk
        return conn.status, conn.headers, body
    finally:
        pool.give(conn)
        pool.close()


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(coro)  # type: ignore[arg-type]


JSON = b'{"ok": true}'
FRAMINGS = {
    "content-length": b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\n" + JSON,
    "chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"5\r\n{\"ok\"\r\n7\r\n: true}\r\n0\r\n\r\n",
    "until the close": b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + JSON,
    "gzip": b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n%s"
            % (len(gzip.compress(JSON)), gzip.compress(JSON)),
    "deflate (zlib)": b"HTTP/1.1 200 OK\r\nContent-Encoding: deflate\r\nContent-Length: %d\r\n\r\n%s"
                      % (len(zlib.compress(JSON)), zlib.compress(JSON)),
}


@pytest.mark.parametrize("framing", list(FRAMINGS))
def test_every_framing_and_encoding_reads_the_same_body(framing: str) -> None:
    async def main() -> None:
        async with Scripted(reply(FRAMINGS[framing], keep=framing != "until the close")) as srv:
            status, _, body = await fetch(srv.url)
            assert (status, json.loads(body)) == (200, {"ok": True})
    run(main())


def test_raw_deflate_without_its_header_is_read() -> None:
    c = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    data = c.compress(JSON) + c.flush()
    raw = b"HTTP/1.1 200 OK\r\nContent-Encoding: deflate\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data)

    async def main() -> None:
        async with Scripted(reply(raw)) as srv:
            assert (await fetch(srv.url))[2] == JSON
    run(main())


OK = b"HTTP/1.1 200 OK\r\n"
HOSTILE = {
    "not http": (b"SSH-2.0-OpenSSH\r\n\r\n", "malformed"),
    "a bad chunk size": (OK + b"Transfer-Encoding: chunked\r\n\r\nzz\r\nab\r\n", "malformed"),
    "a head over the limit": (OK + b"X-A: %s\r\n" % (b"a" * 70_000) + b"\r\n", "head is over"),
    "a header that never ends": (OK + b"X-A: " + b"a" * 70_000, "head is over"),
    "an unknown encoding": (OK + b"Content-Encoding: br\r\nContent-Length: 2\r\n\r\nxx", "'br'"),
    "corrupt gzip": (OK + b"Content-Encoding: gzip\r\nContent-Length: 4\r\n\r\nxxxx", "corrupt"),
    "an upgrade": (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n",
                   "upgrade"),
    "a body cut short (closed)": (OK + b"Content-Length: 100\r\n\r\nonly this", "closed"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_answer_is_a_clear_error(case: str) -> None:
    raw, words = HOSTILE[case]

    async def main() -> None:
        async with Scripted(reply(raw, keep="closed" not in case)) as srv:  # else the engine keeps it open
            with pytest.raises(EngineHTTPError, match=words):
                await fetch(srv.url, timeout_s=3)
    run(main())


def test_a_compression_bomb_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_http, "PAUSE_AT", 1 << 14)  # the decoder's limit is 64x this: 1 MiB
    bomb = gzip.compress(b"\0" * (8 << 20))
    raw = b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n%s" % (len(bomb), bomb)

    async def main() -> None:
        async with Scripted(reply(raw)) as srv:
            with pytest.raises(EngineHTTPError, match="expands beyond"):
                await fetch(srv.url)
    run(main())


def test_a_silent_engine_times_out() -> None:
    async def main() -> None:
        async with Scripted(reply(FRAMINGS["content-length"], wait_s=3.0)) as srv:
            with pytest.raises(TimeoutError):
                await fetch(srv.url, timeout_s=0.3)
    run(main())


def test_a_fast_engine_is_paused_until_the_reader_catches_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_http, "PAUSE_AT", 1 << 16)
    big = bytes(range(256)) * (32 << 10)  # 8 MiB
    raw = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(big), big)

    async def main() -> None:
        async with Scripted(reply(raw)) as srv:
            pool = Pool(srv.url, {}, 5.0, 1)
            conn, _ = await pool.take()
            conn.send(pool.request("/v1/x", b"{}"))
            await conn.head()
            await asyncio.sleep(0.5)  # the engine writes as fast as it can; nobody reads
            assert conn.paused and conn.unread < 4 * engine_http.PAUSE_AT
            got = bytearray()
            while chunk := await conn.chunk():
                got += chunk
            assert got == big and conn.reusable
            pool.give(conn)
            pool.close()
    run(main())


def chat(model: str = "m") -> GenRequest:
    return GenRequest("chat", 4, 1.0, messages=({"role": "user", "content": "hi"},))


WHOLE = json.dumps({"choices": [{
    "message": {"content": "ok"}, "token_ids": [3], "prompt_token_ids": [1], "finish_reason": "stop",
    "logprobs": {"content": [{"logprob": -0.1}]}}]}).encode()
WHOLE_ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(WHOLE), WHOLE)


async def ask(client: AsyncEngineClient) -> str:
    pieces = [p async for p in client.pieces("m", chat(), stream=False)]
    return pieces[0].text


def test_answers_reuse_one_kept_alive_connection() -> None:
    async def main() -> None:
        async with Scripted(reply(WHOLE_ANSWER)) as srv:
            client = AsyncEngineClient(srv.url, timeout_s=5)
            assert [await ask(client) for _ in range(20)] == ["ok"] * 20
            await client.aclose()
            assert (srv.connections, srv.requests) == (1, 20)
    run(main())


def test_a_kept_alive_connection_the_engine_dropped_is_replaced_and_the_request_sent_once() -> None:
    async def answer(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> bool:
        if n == 2:
            return False  # the engine closed the idle connection just as the request came
        return await reply(WHOLE_ANSWER)(r, w, n)

    async def main() -> None:
        async with Scripted(answer) as srv:
            client = AsyncEngineClient(srv.url, timeout_s=5)
            assert [await ask(client) for _ in range(3)] == ["ok"] * 3
            await client.aclose()
            assert srv.connections == 2  # the second request went again, on a new connection
    run(main())


def test_a_new_connection_closed_before_its_answer_is_502_and_not_sent_again() -> None:
    async def main() -> None:
        async with Scripted(reply(b"", keep=False)) as srv:
            client = AsyncEngineClient(srv.url, timeout_s=5)
            with pytest.raises(UpstreamError) as err:
                await ask(client)
            assert err.value.status == 502 and srv.requests == 1
            await client.aclose()
    run(main())


def test_connections_in_use_stay_within_the_limit_and_a_half_read_one_is_not_reused() -> None:
    async def main() -> None:
        async with Scripted(reply(WHOLE_ANSWER, wait_s=0.05)) as srv:
            client = AsyncEngineClient(srv.url, timeout_s=5, max_connections=2)
            assert await asyncio.gather(*(ask(client) for _ in range(10))) == ["ok"] * 10
            assert srv.most_open == 2
            assert (srv.connections, srv.open) == (2, 2)  # both kept alive
            gen = client.pieces("m", chat(), stream=False)
            task = asyncio.ensure_future(gen.__anext__())
            await asyncio.sleep(0.01)
            task.cancel()  # the client left while the engine was answering
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.1)
            assert srv.open == 1  # the engine saw that connection close
            assert await asyncio.gather(ask(client), ask(client)) == ["ok", "ok"]
            assert srv.connections == 3
            await client.aclose()
    run(main())


def test_bytes_after_an_answer_keep_its_connection_from_being_reused() -> None:
    async def main() -> None:
        async with Scripted(reply(WHOLE_ANSWER + b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nbad")) as srv:
            client = AsyncEngineClient(srv.url, timeout_s=5)
            assert [await ask(client) for _ in range(3)] == ["ok"] * 3  # never the stray answer
            assert srv.connections == 3
            await client.aclose()
    run(main())

