"""The OpenAI-compatible API of the gateway, without HTTP, Redis or Kafka (fakes for all three)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from prometheus_client import REGISTRY
from pydantic import SecretStr

from deployer.routing import RoutingTable, assign_arm
from ingest.events import CompletionServed
from services.gateway.exposure import ALSO
from services.gateway.generation import BadRequestError, GenRequest, Piece, UpstreamError
from services.gateway.models import Backend, Generation, ModelSlots
from services.gateway.openai_api import Response
from services.gateway.server import Gateway
from services.settings.services import GatewaySettings

pytestmark = pytest.mark.unit

KEY = "sk-test-123"
AUTH = {"Authorization": f"Bearer {KEY}"}


class StreamBackend:
    """Serves fixed pieces: prompt ids [7, 8], then tokens 5, 6 with text 'he', 'llo'."""

    vocab_size = None

    def __init__(self, fail: Exception | None = None, prompt: list[int] | None = None,
                 fail_after: int | None = None) -> None:
        self.fail = fail
        self.prompt = [7, 8] if prompt is None else prompt
        self.fail_after = fail_after
        self.requests: list[GenRequest] = []

    def generate(self, prompt_tokens: Sequence[int], max_tokens: int, temperature: float) -> Generation:
        return Generation([5, 6], [-0.5, -0.25])

    def stream(self, req: GenRequest, stream: bool = True) -> Iterator[Piece]:
        self.requests.append(req)
        if self.fail is not None and self.fail_after is None:
            raise self.fail
        yield Piece(text="he", tokens=[5], logprobs=[-0.5], prompt_tokens=self.prompt or None,
                    client_logprobs={"tokens": ["he"], "token_logprobs": [-0.5]})
        if self.fail is not None:
            raise self.fail
        yield Piece(text="llo", tokens=[6], logprobs=[-0.25], finish_reason="stop",
                    client_logprobs={"tokens": ["llo"], "token_logprobs": [-0.25]})

    def close(self) -> None:
        pass


def make(stable: Backend | None, canary: Backend | None = None, weight: float = 0.0,
         **settings: Any) -> tuple[Gateway, list[dict[str, Any]], list[tuple[str, str, bool]]]:
    backends = {"1": stable, "2": canary}
    slots = ModelSlots(lambda _arm, version: backends[version])  # type: ignore[arg-type,return-value]
    slots.want("1" if stable else None, "2" if canary else None)
    slots.step()
    table = RoutingTable(weight, "salt", "1", "2" if canary else None)
    logged: list[dict[str, Any]] = []
    counts: list[tuple[str, str, bool]] = []
    cfg = GatewaySettings(**{"api_keys": {"team": SecretStr(KEY)}, **settings})
    gw = Gateway(cfg, slots, lambda: table, logged.append, "rtrl-policy",
                 count=lambda v, a, e, u=None: counts.append((v, a, e) if u is None else (v, a, e, u)))
    return gw, logged, counts


def call(gw: Gateway, path: str, body: dict[str, Any] | bytes | None = None,
         headers: dict[str, str] | None = None, method: str = "POST") -> tuple[Response, Any]:
    raw = body if isinstance(body, bytes) else json.dumps(body or {}).encode()
    sent = AUTH if headers is None else headers
    resp = gw.handle(method, path, raw if method == "POST" else b"", None, sent)
    if resp.stream is not None:
        return resp, b"".join(resp.stream)
    return resp, json.loads(resp.body)


CHAT = {"model": "rtrl-policy", "user": "u1", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "rtrl-policy", "user": "u1", "prompt": "hello"}


def events(raw: bytes) -> list[Any]:
    """The data of each server-sent event."""
    out = []
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


# ------------------------------------------------------------------ auth and models


def test_models_lists_the_served_model() -> None:
    gw, _, _ = make(StreamBackend())
    resp, body = call(gw, "/v1/models", method="GET")
    assert resp.code == 200 and [m["id"] for m in body["data"]] == ["rtrl-policy"]
    assert body["object"] == "list" and body["data"][0]["object"] == "model"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic dTpw"},
                                     {"Authorization": "Bearer "}, {"Authorization": f"Bearer {KEY}x"}])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/models"])
def test_requests_without_a_valid_key_are_401_json(headers: dict[str, str], path: str) -> None:
    gw, logged, _ = make(StreamBackend())
    method = "GET" if path == "/v1/models" else "POST"
    resp, body = call(gw, path, CHAT if "chat" in path else COMPLETION, headers, method)
    assert resp.code == 401 and body["error"]["code"] == "invalid_api_key"
    assert ("WWW-Authenticate", 'Bearer realm="rtrl"') in resp.headers
    assert KEY not in resp.body.decode() and logged == []


def test_requests_are_counted_per_key_id_and_the_key_is_never_a_label() -> None:
    gw, _, _ = make(StreamBackend())
    before = REGISTRY.get_sample_value("rtrl_gateway_client_requests_total", {"key_id": "team"}) or 0.0
    assert call(gw, "/v1/chat/completions", CHAT)[0].code == 200
    after = REGISTRY.get_sample_value("rtrl_gateway_client_requests_total", {"key_id": "team"})
    assert after == before + 1
    from prometheus_client import generate_latest
    assert KEY not in generate_latest(REGISTRY).decode()


def test_anonymous_only_when_explicitly_allowed() -> None:
    gw, _, _ = make(StreamBackend(), api_keys={})
    assert call(gw, "/v1/chat/completions", CHAT, headers={})[0].code == 401
    gw, _, _ = make(StreamBackend(), api_keys={}, allow_anonymous=True)
    assert call(gw, "/v1/chat/completions", CHAT, headers={})[0].code == 200


def test_probes_and_metrics_need_no_key() -> None:
    gw, _, _ = make(StreamBackend())
    resp = gw.handle("GET", "/metrics", b"", None, {})
    assert resp.code == 200 and b"rtrl_gateway_requests_total" in resp.body


# ------------------------------------------------------------------ non-streamed


@pytest.mark.parametrize(("path", "body", "obj"), [
    ("/v1/chat/completions", CHAT, "chat.completion"),
    ("/v1/completions", COMPLETION, "text_completion"),
])
def test_answer_has_openai_fields_and_rtrl_extras(path: str, body: dict[str, Any], obj: str) -> None:
    gw, logged, counts = make(StreamBackend())
    resp, out = call(gw, path, {**body, "request_id": "r-1"})
    assert resp.code == 200 and out["object"] == obj and out["id"] == "r-1"
    assert out["model"] == "rtrl-policy" and isinstance(out["created"], int)
    [choice] = out["choices"]
    text = choice["message"]["content"] if obj == "chat.completion" else choice["text"]
    assert text == "hello" and choice["finish_reason"] == "stop" and choice["logprobs"] is None
    assert out["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}
    [fields] = logged
    assert out["rtrl"] == {"request_id": "r-1", "arm": "stable", "version": "1",
                           "latency_ms": fields["latency_ms"]}
    assert dict(resp.headers) == {"X-Rtrl-Request-Id": "r-1", "X-Rtrl-Arm": "stable",
                                  "X-Rtrl-Model-Version": "1"}
    event = CompletionServed(**fields)  # the contract accepts it
    assert event.prompt_tokens == [7, 8] and event.completion_tokens == [5, 6]
    assert event.logprobs == [-0.5, -0.25] and event.user_key == "u1" and event.session_id == "u1"
    assert counts == [("1", "stable", False)]


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
def test_the_exposure_names_the_sampling_temperature(path: str, body: dict[str, Any]) -> None:
    gw, logged, _ = make(StreamBackend())
    call(gw, path, {**body, "temperature": 0.7})
    call(gw, path, body)
    assert [CompletionServed(**f).temperature for f in logged] == [0.7, 1.0]


def test_logprobs_are_shown_only_when_asked() -> None:
    gw, _, _ = make(StreamBackend())
    _, out = call(gw, "/v1/completions", {**COMPLETION, "logprobs": 1})
    assert out["choices"][0]["logprobs"]["token_logprobs"] == [-0.5, -0.25]


def test_the_request_maps_onto_a_generation_request() -> None:
    backend = StreamBackend()
    gw, _, _ = make(backend)
    call(gw, "/v1/chat/completions", {**CHAT, "max_completion_tokens": 9, "temperature": 0.5,
                                      "top_p": 0.9, "stop": "END", "seed": 3, "logprobs": True,
                                      "top_logprobs": 2, "frequency_penalty": 0.1})
    call(gw, "/v1/completions", {**COMPLETION, "prompt": [[1, 2, 3]], "max_tokens": 4})
    chat, completion = backend.requests
    assert chat.kind == "chat" and chat.messages == ({"role": "user", "content": "hi"},)
    assert (chat.max_tokens, chat.temperature, chat.top_p, chat.stop, chat.seed, chat.logprobs) == \
        (9, 0.5, 0.9, ("END",), 3, 2)
    assert completion.prompt == (1, 2, 3) and completion.max_tokens == 4


@pytest.mark.parametrize(("body", "code", "needle"), [
    ({**CHAT, "model": "gpt-4"}, 404, "does not exist"),
    ({k: v for k, v in CHAT.items() if k != "user"}, 400, "X-Rtrl-User"),
    ({**CHAT, "n": 2}, 400, "n:"),
    ({**CHAT, "messages": []}, 400, "messages"),
    ({**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "text content"),
    ({**CHAT, "temperature": -1}, 400, "temperature"),
    ({**CHAT, "max_tokens": 10**9}, 400, "max_tokens"),
    ({**CHAT, "session_id": "bad id!"}, 400, "session_id"),
    ({**COMPLETION, "prompt": ["a", "b"]}, 400, "prompt"),
    ({**COMPLETION, "prompt": [[1], [2]]}, 400, "prompt"),
    ({**COMPLETION, "prompt": [-1]}, 400, "prompt"),
    ({**COMPLETION, "prompt": ""}, 400, "prompt"),
    ({**COMPLETION, "echo": True}, 400, "echo"),
])
def test_bad_requests_get_openai_errors(body: dict[str, Any], code: int, needle: str) -> None:
    gw, logged, _ = make(StreamBackend())
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    resp, out = call(gw, path, body)
    assert resp.code == code and needle in out["error"]["message"], out
    assert logged == []


def test_user_comes_from_the_header_and_odd_users_are_pseudonymised() -> None:
    gw, logged, _ = make(StreamBackend())
    no_user = {k: v for k, v in CHAT.items() if k != "user"}
    assert call(gw, "/v1/chat/completions", no_user, {**AUTH, "X-Rtrl-User": "u-7"})[0].code == 200
    assert call(gw, "/v1/chat/completions", {**CHAT, "user": "jane@example.com"})[0].code == 200
    first, second = (CompletionServed(**f) for f in logged)
    assert first.user_key == "u-7"
    assert second.user_key.startswith("h-") and "example" not in second.user_key


def test_the_user_is_routed_stickily_like_the_token_api() -> None:
    gw, logged, _ = make(StreamBackend(), StreamBackend(), weight=0.5)
    for i in range(40):
        call(gw, "/v1/chat/completions", {**CHAT, "user": f"u{i}"})
    for fields in logged:
        assert fields["arm"] == assign_arm(fields["user_key"], "salt", 0.5)
    assert {f["arm"] for f in logged} == {"stable", "canary"}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_repeated_request_id_is_409_and_never_logged_twice(path: str) -> None:
    gw, logged, _ = make(StreamBackend())
    body = {**(CHAT if "chat" in path else COMPLETION), "request_id": "dup-1"}
    assert call(gw, path, body)[0].code == 200
    resp, out = call(gw, path, body)
    assert resp.code == 409 and out["error"]["code"] == "duplicate_request_id"
    assert len(logged) == 1


def test_a_repeated_request_id_on_the_token_api_is_409() -> None:
    gw, logged, _ = make(StreamBackend())
    body = {"user_key": "u1", "session_id": "s", "prompt_tokens": [1], "request_id": "dup-2"}
    assert call(gw, "/v1/completions", body)[0].code == 200
    resp, out = call(gw, "/v1/completions", body)
    assert resp.code == 409 and "already served" in out["error"]["message"] and len(logged) == 1


def test_a_failed_request_releases_its_id_for_a_retry() -> None:
    gw, logged, _ = make(StreamBackend(fail=UpstreamError(502, "down")))
    body = {**CHAT, "request_id": "retry-1"}
    assert call(gw, "/v1/chat/completions", body)[0].code == 502
    gw.slots._slots["stable"].backend = StreamBackend()  # the model is back
    assert call(gw, "/v1/chat/completions", body)[0].code == 200 and len(logged) == 1


def test_a_failing_canary_falls_back_to_stable_and_is_counted() -> None:
    gw, logged, counts = make(StreamBackend(), StreamBackend(fail=RuntimeError("boom")), weight=1.0)
    resp, out = call(gw, "/v1/chat/completions", CHAT)
    assert resp.code == 200 and out["rtrl"]["arm"] == "stable"
    # the failure is counted against the canary and the user it failed for (the judge clusters by user)
    assert ("2", "canary", True, logged[0]["user_key"]) in counts and logged[0]["arm"] == "stable"


def test_backend_refusals_are_400_and_engine_errors_keep_their_status() -> None:
    gw, _, _ = make(StreamBackend(fail=BadRequestError("token ids only")))
    resp, out = call(gw, "/v1/chat/completions", CHAT)
    assert resp.code == 400 and "token ids only" in out["error"]["message"]
    gw, _, _ = make(StreamBackend(fail=UpstreamError(504, "slow")))
    assert call(gw, "/v1/chat/completions", CHAT)[0].code == 504


def test_an_answer_without_prompt_ids_is_502_and_not_logged() -> None:
    gw, logged, _ = make(StreamBackend(prompt=[]))
    resp, out = call(gw, "/v1/chat/completions", CHAT)
    assert resp.code == 502 and "prompt's token ids" in out["error"]["message"] and logged == []


def test_no_champion_is_503() -> None:
    gw, _, _ = make(None)
    assert call(gw, "/v1/chat/completions", CHAT)[0].code == 503


# ------------------------------------------------------------------ streamed


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_streaming_sends_chunks_then_done_and_logs_once_at_the_end(path: str) -> None:
    gw, logged, _ = make(StreamBackend())
    body = {**(CHAT if "chat" in path else COMPLETION), "stream": True,
            "stream_options": {"include_usage": True}}
    resp = gw.handle("POST", path, json.dumps(body).encode(), None, AUTH)
    assert resp.code == 200 and resp.content_type == "text/event-stream" and resp.stream is not None
    assert logged == []  # nothing is logged before the stream is sent
    got = events(b"".join(resp.stream))
    assert got[-1] == "[DONE]"
    *chunks, usage = got[:-1]
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 4
    if "chat" in path:
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    else:
        text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == "hello" and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[0]["rtrl"]["arm"] == "stable" and len({c["id"] for c in chunks}) == 1
    [fields] = logged
    assert CompletionServed(**fields).completion_tokens == [5, 6]


def test_a_stream_that_breaks_sends_an_error_event_and_logs_what_was_served() -> None:
    gw, logged, _ = make(StreamBackend(fail=UpstreamError(502, "engine died"), fail_after=1))
    resp = gw.handle("POST", "/v1/chat/completions", json.dumps({**CHAT, "stream": True}).encode(),
                     None, AUTH)
    assert resp.stream is not None
    got = events(b"".join(resp.stream))
    assert "[DONE]" not in got and "engine died" in got[-1]["error"]["message"]
    [fields] = logged
    assert fields["completion_tokens"] == [5]


def test_a_client_that_disconnects_mid_stream_still_gets_its_exposure_logged() -> None:
    gw, logged, _ = make(StreamBackend())
    resp = gw.handle("POST", "/v1/chat/completions", json.dumps({**CHAT, "stream": True}).encode(),
                     None, AUTH)
    assert resp.stream is not None
    next(resp.stream)
    resp.stream.close()  # what the transport does when a write fails  # type: ignore[attr-defined]
    [fields] = logged
    assert fields["completion_tokens"] == [5]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_non_json_number_literals_are_malformed_json(path: str) -> None:
    gw, logged, _ = make(StreamBackend())
    resp = gw.handle("POST", path, b'{"user": "u1", "prompt": "x", "messages": [], "temperature": NaN}',
                     None, AUTH)
    assert resp.code == 400 and b"malformed JSON: NaN is not valid JSON" in resp.body and logged == []


# ------------------------------------------------------------------ agent sessions

@pytest.mark.parametrize(("body", "headers", "turn", "session"), [
    ({}, {}, None, "u1"),  # the session defaults to the user: no session events
    ({}, {"X-Rtrl-Session-Id": ""}, None, "u1"),  # an empty header names no session
    ({"session_id": "s-1"}, {}, 1, "s-1"),  # one assistant message in the history: turn 1
    ({}, {"X-Rtrl-Session-Id": "s-1"}, 1, "s-1"),
    ({"session_id": "s-1", "turn": 7}, {"X-Rtrl-Turn": "5"}, 7, "s-1"),  # a self-summary's client says
    ({"session_id": "s-1"}, {"X-Rtrl-Turn": "5"}, 5, "s-1"),
])
def test_a_named_session_logs_its_turn_with_the_served_event(body: dict[str, Any], headers: dict[str, str],
                                                               turn: int | None, session: str) -> None:
    gw, logged, _ = make(StreamBackend())
    history = [{"role": "user", "content": "fix it"}, {"role": "assistant", "content": "which file?"},
               {"role": "user", "content": "app.py"}]
    resp, _ = call(gw, "/v1/chat/completions", {**CHAT, "messages": history, **body}, {**AUTH, **headers})
    assert resp.code == 200
    [fields] = logged
    assert fields["session_id"] == session
    also = fields.get(ALSO)
    if turn is None:
        assert also is None
    else:
        assert [(e["type"], e["turn"], e["session_id"], e["request_id"]) for e in also] == [
            ("session.turn", turn, session, fields["request_id"])]


def test_a_completion_in_a_named_session_needs_its_turn_index() -> None:
    gw, logged, _ = make(StreamBackend())
    call(gw, "/v1/completions", {**COMPLETION, "session_id": "s-2"})
    call(gw, "/v1/completions", {**COMPLETION, "session_id": "s-2", "turn": 3})
    assert ALSO not in logged[0] and [e["turn"] for e in logged[1][ALSO]] == [3]
