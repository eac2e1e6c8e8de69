"""Upstream mode: the gateway forwards each arm to an OpenAI-compatible server (a fake one
started here, standing in for a team's vLLM) and logs real token ids and logprobs."""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import SecretStr

from bench.fake_upstream import FakeCompletionsServer
from deployer.routing import assign_arm
from ingest.contracts.keys import routing_keys
from ingest.events import CompletionServed, parse_event
from services.gateway.asgi.app import GatewayServer
from services.runtime.health import Health
from services.runtime.kafka_io import ensure_topics, make_consumer
from services.runtime.redis_io import make_redis
from services.settings.model import Settings
from services.settings.services import GatewaySettings, UpstreamSettings
from services.wiring.gateway import build


class Upstreams:
    def __init__(self, settings: Settings, text_tokens: bool = False, **gw: Any) -> None:
        self.stable = FakeCompletionsServer(text_tokens=text_tokens).start()
        self.canary = FakeCompletionsServer(text_tokens=text_tokens).start()
        self.settings = settings.model_copy(update={"gateway": GatewaySettings(**{
            "port": 0, "routing_poll_s": 0.2, "key_id": None, "allow_anonymous": True,
            "stable_upstream": UpstreamSettings(base_url=self.stable.url, model="team-model",
                                                api_key=SecretStr("k-stable")),
            "canary_upstream": UpstreamSettings(base_url=self.canary.url, model="team-model-next"),
            **gw,
        })})
        ensure_topics(self.settings, [self.settings.topics.raw])
        self.gateway, self.parts = build(self.settings, Health())
        self.server = GatewayServer(self.gateway, "127.0.0.1", 0).start()
        self.conn = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=10)

    def post(self, user: str, **extra: Any) -> tuple[int, dict[str, Any]]:
        body = {"user_key": user, "session_id": "s", "prompt_tokens": [0, 4, 5], "max_tokens": 3, **extra}
        self.conn.request("POST", "/v1/completions", body=json.dumps(body).encode())
        resp = self.conn.getresponse()
        return resp.status, json.loads(resp.read())

    def wait_for(self, arm: str) -> None:
        deadline = time.monotonic() + 10
        while self.gateway.slots.get(arm) is None:  # type: ignore[arg-type]
            assert time.monotonic() < deadline, f"{arm} upstream never became available"
            time.sleep(0.05)

    def stop(self) -> None:
        self.conn.close()
        self.server.stop()
        for part in self.parts:
            part.stop()
        self.stable.stop()
        self.canary.stop()


@pytest.fixture
def upstreams(settings: Settings) -> Iterator[Upstreams]:
    ups = Upstreams(settings)
    yield ups
    ups.stop()


def test_forwards_token_prompts_and_logs_token_ids(upstreams: Upstreams) -> None:
    upstreams.wait_for("stable")
    code, body = upstreams.post("alice", request_id="up-1", temperature=0.7)
    assert code == 200, body
    [sent] = upstreams.stable.requests
    assert sent["prompt"] == [0, 4, 5] and sent["max_tokens"] == 3 and sent["temperature"] == 0.7
    assert sent["return_tokens_as_token_ids"] is True and sent["logprobs"] == 1
    assert sent["model"] == "team-model" and sent["_authorization"] == "Bearer k-stable"
    assert body["completion_tokens"] == [12, 13, 14] and body["logprobs"] == [-0.5, -0.5, -0.5]
    assert body["model"] == {"name": "team-model", "version": "team-model"} and body["arm"] == "stable"
    consumer = make_consumer(upstreams.settings.kafka, None, [upstreams.settings.topics.raw])
    records: list[Any] = []
    deadline = time.monotonic() + 20
    while not records and time.monotonic() < deadline:
        for batch in consumer.poll(timeout_ms=200).values():
            records.extend(batch)
    consumer.close()
    [rec] = records
    event = parse_event(rec.value)
    assert isinstance(event, CompletionServed) and event.completion_tokens == [12, 13, 14]


def test_canary_arm_goes_to_the_canary_endpoint_with_the_routed_version(upstreams: Upstreams) -> None:
    keys = routing_keys(upstreams.settings.redis.key_prefix)
    make_redis(upstreams.settings.redis).mset({
        keys["stable_version"]: "7", keys["canary_version"]: "8",
        keys["canary_weight"]: "0.5", keys["salt"]: "up-salt"})
    upstreams.wait_for("canary")
    time.sleep(0.3)  # the stable label follows the table on the next poll
    for i in range(20):
        user = f"user-{i}"
        code, body = upstreams.post(user)
        arm = assign_arm(user, "up-salt", 0.5)
        assert code == 200 and body["arm"] == arm
        assert body["model"]["version"] == ("8" if arm == "canary" else "7")
    assert upstreams.canary.requests and upstreams.stable.requests
    assert all(r["model"] == "team-model-next" for r in upstreams.canary.requests)


def test_text_tokens_fail_clearly_unless_hashing_is_chosen(settings: Settings) -> None:
    ups = Upstreams(settings, text_tokens=True)
    try:
        ups.wait_for("stable")
        code, body = ups.post("bob")
        assert code == 502 and "return_tokens_as_token_ids" in body["error"]["message"]
    finally:
        ups.stop()
    ups = Upstreams(settings, text_tokens=True, upstream_token_ids="hash")
    try:
        ups.wait_for("stable")
        code, body = ups.post("bob")
        assert code == 200 and len(body["completion_tokens"]) == 3
        assert all(0 <= t < 2**31 for t in body["completion_tokens"])
    finally:
        ups.stop()


def test_failing_canary_endpoint_falls_back_to_stable(upstreams: Upstreams) -> None:
    upstreams.canary.status = 500
    keys = routing_keys(upstreams.settings.redis.key_prefix)
    make_redis(upstreams.settings.redis).mset({keys["canary_version"]: "9", keys["canary_weight"]: "1"})
    upstreams.wait_for("canary")
    code, body = upstreams.post("carol")
    assert code == 200 and body["arm"] == "stable" and len(upstreams.canary.requests) == 1
