"""The pieces behind the OpenAI API: the engine's answers parsed, local text, API keys,
request ids, and chunked streaming over the real HTTP server."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import fakeredis
import pytest
from pydantic import SecretStr

from services.gateway.asgi.app import GatewayServer
from services.gateway.auth import ApiKeys, UnauthorizedError
from services.gateway.engine_backend import (
    EngineBackend,
    EngineClient,
    engine_body,
    engine_error,
    parse_choice,
)
from services.gateway.generation import LOGPROB_FLOOR, BadRequestError, GenRequest, Served, UpstreamError
from services.gateway.local_text import pieces, prompt_ids, strip_stop, token_texts
from services.gateway.request_ids import RequestIds
from tests.unit.test_gateway_openai import AUTH, CHAT, StreamBackend, make

pytestmark = pytest.mark.unit


# ------------------------------------------------------------------ the engine's answers


def test_completion_answer_gives_ids_and_sampled_logprobs() -> None:
    data = {"choices": [{"text": "ab", "token_ids": [3, 4], "prompt_token_ids": [1, 2],
                         "logprobs": {"tokens": ["a", "b"], "token_logprobs": [-0.1, None]},
                         "finish_reason": "length"}]}
    p = parse_choice("completion", data)
    assert (p.text, p.tokens, p.prompt_tokens, p.finish_reason) == ("ab", [3, 4], [1, 2], "length")
    assert p.logprobs == [-0.1, LOGPROB_FLOOR]  # a missing logprob keeps the event valid


def test_chat_answer_reads_top_level_prompt_ids_and_content_logprobs() -> None:
    data = {"prompt_token_ids": [9], "choices": [{
        "message": {"role": "assistant", "content": "x"}, "token_ids": [5],
        "logprobs": {"content": [{"token": "x", "logprob": 0.0001}]}, "finish_reason": "stop"}]}
    p = parse_choice("chat", data)
    assert p.prompt_tokens == [9] and p.tokens == [5] and p.logprobs == [0.0]  # clipped to <= 0


def test_stream_delta_without_content_is_an_empty_piece() -> None:
    p = parse_choice("chat", {"choices": [{"delta": {"role": "assistant"}, "finish_reason": None}]})
    assert p.text == "" and p.tokens == [] and p.prompt_tokens is None


@pytest.mark.parametrize("data", [{}, {"choices": []}, {"choices": ["x"]}, [],
                                  {"choices": [{"token_ids": [1.5]}]}, {"choices": [{"token_ids": [-1]}]},
                                  {"choices": [{"token_ids": [True]}]}])
def test_malformed_engine_answers_are_502(data: Any) -> None:
    with pytest.raises(UpstreamError) as err:
        parse_choice("completion", data)
    assert err.value.status == 502


def test_engine_body_asks_for_ids_and_logprobs() -> None:
    chat = engine_body(GenRequest("chat", 5, 0.7, messages=({"role": "user", "content": "hi"},), seed=1,
                                  stop=("x",)), "m", True)
    assert chat["return_token_ids"] is True and chat["logprobs"] is True and chat["top_logprobs"] == 0
    assert chat["stream"] is True and chat["model"] == "m" and chat["seed"] == 1 and chat["stop"] == ["x"]
    comp = engine_body(GenRequest("completion", 5, 1.0, prompt=(1, 2), logprobs=3), "m", False)
    assert comp["prompt"] == [1, 2] and comp["logprobs"] == 3 and "messages" not in comp


@pytest.mark.parametrize(("status", "code"), [(400, 400), (422, 400), (404, 502), (500, 502), (503, 502)])
def test_engine_errors_map_to_client_or_gateway_errors(status: int, code: int) -> None:
    err = engine_error(status, {"error": {"message": "too long"}})
    assert err.status == code and "too long" in str(err)


# ------------------------------------------------------------------ local text


class CharTokenizer:
    """One token per character (id = code point); '#' is EOS."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids if not (skip_special_tokens and chr(i) == "#"))

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [chr(i) for i in ids]

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        return self.encode("".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>")


def test_text_and_chat_prompts_need_a_tokenizer() -> None:
    tok = CharTokenizer()
    assert prompt_ids(GenRequest("completion", 4, prompt="ab"), tok) == [97, 98]
    assert prompt_ids(GenRequest("completion", 4, prompt=(1, 2)), None) == [1, 2]
    chat = GenRequest("chat", 4, messages=({"role": "user", "content": "a"},))
    assert prompt_ids(chat, tok) == tok.encode("<user>a<assistant>")
    for req in (GenRequest("completion", 4, prompt="ab"), chat):
        with pytest.raises(BadRequestError, match="token ids only"):
            prompt_ids(req, None)


def test_pieces_cut_at_a_stop_string_and_keep_ids_and_logprobs_aligned() -> None:
    tok = CharTokenizer()
    req = GenRequest("completion", 8, prompt="p", stop=("cd",), logprobs=0)
    out = Served()
    for p in pieces(req, tok, [112], tok.encode("abcdef"), [-1.0] * 6, eos_ended=False):
        out.add(p)
    assert out.text == "ab" and out.tokens == tok.encode("abcd") and out.logprobs == [-1.0] * 4
    assert out.finish_reason == "stop" and out.prompt_tokens == [112] and out.problem() is None
    assert [c["tokens"] for c in out.client_logprobs] == [["a"], ["b"], ["c"], ["d"]]


def test_pieces_without_a_tokenizer_carry_ids_only() -> None:
    out = Served()
    for p in pieces(GenRequest("completion", 2, prompt=(1,)), None, [1], [5, 6], [-1.0, -2.0], False):
        out.add(p)
    assert out.text == "" and out.tokens == [5, 6] and out.finish_reason == "length"


def test_an_empty_generation_is_one_piece_with_the_prompt() -> None:
    [p] = list(pieces(GenRequest("completion", 2, prompt=(1,)), None, [1], [], [], True))
    assert p.prompt_tokens == [1] and p.finish_reason == "stop"


def test_helpers_for_text() -> None:
    assert strip_stop("abcXdeY", ["Y", "X"]) == "abc" and strip_stop("abc", ["z"]) == "abc"
    assert token_texts(CharTokenizer(), [97, 35, 98]) == ["a", "", "b"]


# ------------------------------------------------------------------ API keys and request ids


def test_api_keys_are_matched_by_value_and_return_their_id() -> None:
    keys = ApiKeys({"a": SecretStr("k1"), "b": SecretStr("k2")})
    assert keys.key_id("Bearer k2") == "b" and keys.key_id("bearer  k1 ") == "a"
    for header in (None, "", "Bearer", "Bearer k3", "Token k1", "k1"):
        with pytest.raises(UnauthorizedError) as err:
            keys.key_id(header)
        assert "k1" not in str(err.value) and "k2" not in str(err.value)
    assert ApiKeys({}, allow_anonymous=True).key_id(None) == "anonymous"
    assert not ApiKeys({}).configured and ApiKeys({}, True).configured


def test_request_ids_are_claimed_once_across_replicas_and_released_on_failure() -> None:
    server = fakeredis.FakeServer()
    one = RequestIds(fakeredis.FakeRedis(server=server), "p:")
    two = RequestIds(fakeredis.FakeRedis(server=server), "p:")
    assert one.claim("r1") and not one.claim("r1") and not two.claim("r1")
    one.release("r1")
    assert two.claim("r1")
    assert 0 < fakeredis.FakeRedis(server=server).ttl("p:gateway:rid:r1") <= 8 * 86_400


class DownRedis:
    def set(self, *_a: Any, **_k: Any) -> None:
        raise ConnectionError("down")

    def delete(self, *_a: Any) -> None:
        raise ConnectionError("down")


def test_request_ids_fall_back_to_memory_while_redis_is_down() -> None:
    ids = RequestIds(DownRedis(), "p:")
    assert ids.claim("r1") and not ids.claim("r1")
    ids.release("r1")
    assert ids.claim("r1")


# ------------------------------------------------------------------ streaming over HTTP


class SlowStream(StreamBackend):
    def stream(self, req: GenRequest, stream: bool = True) -> Iterator[Any]:
        yield from super().stream(req, stream)


def test_sse_over_http_is_chunked_and_the_connection_is_reused() -> None:
    gw, logged, _ = make(SlowStream())
    srv = GatewayServer(gw, "127.0.0.1", 0).start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=5)
        for i in range(2):
            body = json.dumps({**CHAT, "stream": True, "request_id": f"s{i}"})
            conn.request("POST", "/v1/chat/completions", body, {**AUTH, "Content-Type": "application/json"})
            resp = conn.getresponse()
            assert resp.status == 200 and resp.getheader("Transfer-Encoding") == "chunked"
            assert resp.getheader("Content-Type") == "text/event-stream"
            assert resp.getheader("X-Rtrl-Request-Id") == f"s{i}"
            raw = resp.read().decode()
            assert raw.endswith("data: [DONE]\n\n") and '"content":"he"' in raw
        conn.close()
    finally:
        srv.stop()
    assert [f["request_id"] for f in logged] == ["s0", "s1"]


# ------------------------------------------------------------------ an engine's stream, read to its end


class _RawEngine:
    """An engine speaking raw HTTP/1.1 on a loopback socket: each request is answered with one
    streamed chat event and ``[DONE]``, then ``after_done`` bytes of further chunks (0: the
    closing chunk at once; -1: chunks for ever). Counts connections and requests."""

    def __init__(self, after_done: int) -> None:
        self.after_done = after_done
        self.connections = self.requests = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as rfile:
            try:
                while rfile.readline():
                    length, headers = 0, []
                    while (header := rfile.readline()) not in (b"\r\n", b""):
                        headers.append(header.lower())
                        if header.lower().startswith(b"content-length:"):
                            length = int(header.split(b":")[1])
                    body = rfile.read(length)
                    self.requests += 1
                    if not self._answer(conn, headers, body):
                        return
            except OSError:
                return

    def _answer(self, conn: socket.socket, headers: list[bytes], body: bytes) -> bool:
        """Answer one request (its lower-cased header lines and body); False: close the connection."""
        def chunk(data: bytes) -> bytes:
            return b"%x\r\n%s\r\n" % (len(data), data)

        event = {"choices": [{"delta": {"content": "hi"}, "token_ids": [7], "prompt_token_ids": [1],
                              "logprobs": {"content": [{"logprob": -0.5}]}, "finish_reason": "stop"}]}
        head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        data = chunk(b"data: " + json.dumps(event).encode() + b"\n\n") + chunk(b"data: [DONE]\n\n")
        conn.sendall(head + data)
        sent = 0
        while self.after_done < 0 or sent < self.after_done:
            if self._stop.wait(0.001):
                return False
            conn.sendall(chunk(b": " + b"x" * 1022 + b"\n"))
            sent += 1024
        conn.sendall(b"0\r\n\r\n")
        return True

    def stop(self) -> None:
        self._stop.set()
        self._listener.close()


@pytest.mark.parametrize("after_done", [0, 4096, -1], ids=["closing-chunk", "short-tail", "endless-tail"])
def test_an_engines_stream_is_read_to_its_end_and_each_request_sent_once(after_done: int) -> None:
    """After ``[DONE]`` the rest of the stream is read, so the next request goes out once on the
    same connection; an engine that keeps sending after ``[DONE]`` costs a fresh connection,
    never a request sent twice or a stream read for ever."""

    engine = _RawEngine(after_done)
    client = EngineClient(engine.url, timeout_s=5)
    backend = EngineBackend(client, "base")
    req = GenRequest("chat", 4, 1.0, messages=({"role": "user", "content": "hi"},))
    try:
        for _ in range(3):
            t0 = time.monotonic()
            pieces = list(backend.stream(req, stream=True))
            assert [t for p in pieces for t in p.tokens] == [7]
            assert time.monotonic() - t0 < 3.0
        assert engine.requests == 3
        assert engine.connections == (3 if after_done < 0 else 1)
    finally:
        client.close()
        engine.stop()
