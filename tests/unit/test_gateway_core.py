"""The gateway's request handling, without HTTP, Redis or Kafka (fakes for all three)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest

from deployer.routing import RoutingTable, assign_arm
from ingest.contracts.prometheus import GATEWAY_FALLBACKS
from ingest.events import CompletionServed
from services.gateway.generation import UpstreamError
from services.gateway.models import Backend, Generation, ModelSlots
from services.gateway.server import Gateway
from services.settings.services import GatewaySettings


class FakeBackend:
    def __init__(self, tokens: list[int] | None = None, fail: Exception | None = None,
                 vocab_size: int | None = 64) -> None:
        self.tokens = tokens if tokens is not None else [5, 6, 1]
        self.fail = fail
        self.vocab_size = vocab_size
        self.calls: list[tuple[list[int], int, float]] = []

    def generate(self, prompt_tokens: Sequence[int], max_tokens: int, temperature: float) -> Generation:
        self.calls.append((list(prompt_tokens), max_tokens, temperature))
        if self.fail is not None:
            raise self.fail
        toks = self.tokens[:max_tokens]
        return Generation(toks, [-0.5] * len(toks))

    def close(self) -> None:
        pass


def make(stable: Backend | None, canary: Backend | None = None, weight: float = 0.0,
         **settings: Any) -> tuple[Gateway, list[dict[str, Any]]]:
    backends = {"1": stable, "2": canary}

    def loader(arm: str, version: str) -> Backend:
        b = backends[version]
        assert b is not None
        return b

    slots = ModelSlots(loader)  # type: ignore[arg-type]
    slots.want("1" if stable else None, "2" if canary else None)
    slots.step()
    table = RoutingTable(weight, "salt", "1", "2" if canary else None)
    logged: list[dict[str, Any]] = []
    gw = Gateway(GatewaySettings(**{"allow_anonymous": True, **settings}), slots, lambda: table,
                 logged.append, "rtrl-policy")
    return gw, logged


def post(gw: Gateway, body: dict[str, Any] | bytes) -> tuple[int, dict[str, Any]]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = gw.handle("POST", "/v1/completions", raw)
    return resp.code, json.loads(resp.body)


REQ = {"user_key": "u1", "session_id": "s1", "prompt_tokens": [0, 7, 8]}


def test_serves_and_logs_one_valid_exposure() -> None:
    gw, logged = make(FakeBackend([5, 6, 1]))
    code, body = post(gw, {**REQ, "request_id": "r-1", "max_tokens": 2})
    assert code == 200
    assert body["request_id"] == "r-1" and body["arm"] == "stable"
    assert body["model"] == {"name": "rtrl-policy", "version": "1"}
    assert body["completion_tokens"] == [5, 6] and body["logprobs"] == [-0.5, -0.5]
    assert body["completion_kind"] == "edit" and body["tool_calls"] == 0
    assert set(body) == {"request_id", "model", "arm", "completion_tokens", "logprobs",
                         "completion_kind", "latency_ms", "tool_calls", "invalid_tool_calls"}
    [fields] = logged
    event = CompletionServed(**fields)
    assert event.request_id == "r-1" and event.prompt_tokens == [0, 7, 8]
    assert event.model.version == "1" and event.latency_ms == body["latency_ms"]


def test_defaults_generated_request_id_and_max_tokens() -> None:
    backend = FakeBackend(list(range(3, 40)))
    gw, logged = make(backend, default_max_tokens=7)
    code, body = post(gw, REQ)
    assert code == 200 and len(body["completion_tokens"]) == 7 and backend.calls[0][1:] == (7, 1.0)
    assert len(body["request_id"]) == 32 and logged[0]["request_id"] == body["request_id"]


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"{not json", "malformed JSON"),
        (b"[1,2]", "invalid request"),
        ({**REQ, "prompt_tokens": [1, -2]}, "prompt_tokens.1"),
        ({**REQ, "prompt_tokens": []}, "prompt_tokens"),
        ({**REQ, "max_tokens": 0}, "max_tokens"),
        ({**REQ, "max_tokens": 257}, "max_tokens"),
        ({**REQ, "temperature": 0}, "temperature"),
        ({**REQ, "user_key": "has space"}, "user_key"),
        ({"session_id": "s", "prompt_tokens": [1]}, "user_key: Field required"),
        ({**REQ, "prompt_tokens": [0, 64]}, "vocabulary size 64"),
    ],
)
def test_bad_requests_are_400_with_a_clear_message(body: Any, needle: str) -> None:
    gw, logged = make(FakeBackend())
    code, resp = post(gw, body)
    assert code == 400 and needle in resp["error"]["message"] and logged == []


def test_unknown_fields_are_ignored() -> None:
    gw, _ = make(FakeBackend())
    assert post(gw, {**REQ, "extra": 1})[0] == 200


def test_paths_and_methods() -> None:
    gw, _ = make(FakeBackend())
    assert gw.handle("GET", "/nope", b"").code == 404
    assert gw.handle("GET", "/v1/completions", b"").code == 405
    assert gw.handle("POST", "/metrics", b"").code == 405
    assert gw.handle("DELETE", "/v1/routing", b"").code == 405
    assert gw.handle("GET", "/metrics", b"").code == 200
    assert b"rtrl_gateway_requests_total" in gw.handle("GET", "/metrics", b"").body
    assert gw.handle("GET", "/healthz", b"").code == 200
    assert json.loads(gw.handle("GET", "/v1/routing", b"").body) == {
        "canary_weight": 0.0, "stable": {"version": "1"}, "canary": None, "salt": "salt", "holdout": None}


def test_no_champion_is_503() -> None:
    gw, logged = make(None)
    code, body = post(gw, REQ)
    assert code == 503 and "no champion" in body["error"]["message"] and logged == []


def test_routes_by_sticky_hash() -> None:
    gw, logged = make(FakeBackend([5]), FakeBackend([6]), weight=0.5)
    for i in range(40):
        user = f"user-{i}"
        code, body = post(gw, {**REQ, "user_key": user})
        want = assign_arm(user, "salt", 0.5)
        assert code == 200 and body["arm"] == want
        assert body["model"]["version"] == ("2" if want == "canary" else "1")
        assert body["completion_tokens"] == ([6] if want == "canary" else [5])
    assert {e["arm"] for e in logged} == {"stable", "canary"}


def test_failing_canary_is_served_by_stable_and_counted() -> None:
    gw, logged = make(FakeBackend([5]), FakeBackend(fail=RuntimeError("boom")), weight=1.0)
    before = GATEWAY_FALLBACKS._value.get()
    code, body = post(gw, REQ)
    assert code == 200 and body["arm"] == "stable" and body["model"]["version"] == "1"
    assert logged[0]["arm"] == "stable" and logged[0]["model"]["version"] == "1"
    assert GATEWAY_FALLBACKS._value.get() == before + 1


def test_stable_failure_maps_to_500_or_upstream_code() -> None:
    gw, logged = make(FakeBackend(fail=RuntimeError("boom")))
    code, body = post(gw, REQ)
    assert code == 500 and "boom" in body["error"]["message"] and logged == []
    gw, _ = make(FakeBackend(fail=UpstreamError(504, "upstream did not answer")))
    assert post(gw, REQ)[0] == 504


def test_simulated_latency_is_added_and_optionally_slept() -> None:
    gw, logged = make(FakeBackend([5, 6, 7, 1]), simulated_ms_per_token=20.0)
    code, body = post(gw, REQ)
    assert code == 200 and 80.0 <= body["latency_ms"] < 200.0
    assert logged[0]["latency_ms"] == body["latency_ms"]
    gw, _ = make(FakeBackend([5]), simulated_ms_per_token=30.0, sleep_simulated_latency=True)
    import time

    t0 = time.perf_counter()
    post(gw, REQ)
    assert time.perf_counter() - t0 >= 0.03


def test_completion_kind() -> None:
    gw, _ = make(FakeBackend([2, 9, 1]))
    assert post(gw, REQ)[1]["completion_kind"] == "question"
    gw, _ = make(FakeBackend([1]))
    assert post(gw, REQ)[1]["completion_kind"] == "empty"


@pytest.mark.parametrize(("content_type", "code"), [
    (None, 200), ("application/json", 200), ("application/json; charset=utf-8", 200),
    ("Application/JSON", 200), ("application/vnd.api+json", 200),
    ("text/plain", 415), ("application/x-www-form-urlencoded", 415), ("multipart/form-data; b=x", 415),
])
def test_content_type_must_be_json_when_given(content_type: str | None, code: int) -> None:
    gw, _ = make(FakeBackend())
    resp = gw.handle("POST", "/v1/completions", json.dumps(REQ).encode(), content_type)
    assert resp.code == code
    if code == 415:
        assert "application/json" in json.loads(resp.body)["error"]["message"]


def test_the_exposure_names_the_sampling_temperature() -> None:
    backend = FakeBackend([5, 6, 1])
    gw, logged = make(backend)
    post(gw, {**REQ, "temperature": 0.7})
    post(gw, REQ)
    assert [c[2] for c in backend.calls] == [0.7, 1.0]
    assert [CompletionServed(**f).temperature for f in logged] == [0.7, 1.0]


def test_a_token_request_that_names_its_turn_logs_the_sessions_turn() -> None:
    from services.gateway.exposure import ALSO, exposure_events

    gw, logged = make(FakeBackend([5, 6, 1]))
    assert post(gw, {**REQ, "request_id": "r-a"})[0] == 200
    assert post(gw, {**REQ, "request_id": "r-b", "turn": 4})[0] == 200
    plain, turn = logged
    assert ALSO not in plain
    events = exposure_events(turn)
    assert [(e.type, getattr(e, "turn", None), getattr(e, "session_id", None), e.request_id)
            for e in events] == [("session.turn", 4, "s1", "r-b"), ("completion.served", None, "s1", "r-b")]


@pytest.mark.parametrize("turn", ["4", True, -1, 2.0, 1_000_000, None.__class__.__name__])
def test_a_turn_that_is_not_a_plain_index_is_400_naming_it(turn: Any) -> None:
    gw, logged = make(FakeBackend())
    code, body = post(gw, {**REQ, "turn": turn})
    assert code == 400 and "turn" in body["error"]["message"] and not logged
