"""The gateway against real Redis, the real broker and a sqlite-backed MLflow registry:
requests are served from the champion, each leaves a signed completion.served on the raw
topic, weight changes in Redis move users within seconds, a broken canary falls back."""

from __future__ import annotations

import http.client
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from deployer.adapters.mlflow_registry import MlflowRegistry
from deployer.adapters.served_counts import read_counts
from deployer.routing import assign_arm
from ingest.auth import AuthPolicy, authenticate
from ingest.contracts.keys import routing_keys
from ingest.contracts.prometheus import GATEWAY_ERRORS, GATEWAY_EXPOSURES, GATEWAY_MODEL_LOADS
from ingest.events import CompletionServed, parse_event
from services.gateway.asgi.app import GatewayServer
from services.runtime.health import Health
from services.runtime.kafka_io import ensure_topics, make_consumer
from services.runtime.redis_io import make_redis
from services.settings.model import MlflowSettings, Settings
from services.settings.services import GatewaySettings
from services.wiring.gateway import build
from trainer.policy import TinyConfig, TinyTransformer, write_manifest

SECRET = "gw-secret"
SMALL = TinyConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, max_len=64)


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, dict[str, str]]:
    """A sqlite MLflow registry with champion v1, a good v2 and a v3 that cannot load."""
    root = tmp_path_factory.mktemp("gw-mlflow")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    name = f"rtrl-policy-{uuid.uuid4().hex[:6]}"
    reg = MlflowRegistry(uri, name)
    versions = {}
    for label, seed in (("good1", 1), ("good2", 2)):
        import torch

        torch.manual_seed(seed)
        versions[label] = reg.register(None, TinyTransformer(SMALL).save(root / label))
    broken = root / "broken"
    write_manifest(broken, "tiny-transformer", {"d_model": 32})  # no weights: load fails
    versions["broken"] = reg.register(None, broken)
    reg.set_alias("champion", versions["good1"])
    return uri, name, versions


def gateway_settings(settings: Settings, registry: tuple[str, str, dict[str, str]], **gw: Any) -> Settings:
    uri, name, _ = registry
    return settings.model_copy(update={
        "mlflow": MlflowSettings(tracking_uri=uri, registered_model=name),
        "gateway": GatewaySettings(**{"port": 0, "routing_poll_s": 0.2, "allow_anonymous": True,
                                      "key_id": "gateway",
                                      "secret": SecretStr(SECRET), "load_retry_s": 60, **gw}),
    })


class Running:
    def __init__(self, settings: Settings) -> None:
        ensure_topics(settings, [settings.topics.raw])
        self.settings = settings
        self.health = Health()
        self.gateway, self.parts = build(settings, self.health)
        self.server = GatewayServer(self.gateway, "127.0.0.1", 0).start()
        self.conn = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=10)

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, dict[str, Any]]:
        raw = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        self.conn.request(method, path, body=raw, headers={"Content-Type": "application/json"})
        resp = self.conn.getresponse()
        data = resp.read()
        if resp.getheader("Connection") == "close":
            self.conn.close()
        return resp.status, json.loads(data) if data.startswith(b"{") else {"raw": data.decode()}

    def complete(self, user: str, **extra: Any) -> dict[str, Any]:
        code, body = self.request("POST", "/v1/completions",
                                  {"user_key": user, "session_id": "s1", "prompt_tokens": [0, 5, 9], **extra})
        assert code == 200, body
        return body

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.request("GET", "/readyz")[0] == 200:
                return
            time.sleep(0.1)
        raise AssertionError(f"gateway not ready: {self.request('GET', '/readyz')}")

    def stop(self) -> None:
        self.conn.close()
        self.server.stop()
        poller, slots, exposures, counts = self.parts
        poller.stop()
        slots.stop()
        exposures.stop()
        counts.stop()


@pytest.fixture
def running(settings: Settings, registry: tuple[str, str, dict[str, str]]) -> Iterator[Running]:
    gw = Running(gateway_settings(settings, registry))
    yield gw
    gw.stop()


def set_routing(settings: Settings, **values: str) -> None:
    keys = routing_keys(settings.redis.key_prefix)
    make_redis(settings.redis).mset({keys[k]: v for k, v in values.items()})


def raw_records(settings: Settings, want: int, timeout_s: float = 20.0) -> list[Any]:
    consumer = make_consumer(settings.kafka, None, [settings.topics.raw], isolation_level="read_uncommitted")
    found: list[Any] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(found) < want and time.monotonic() < deadline:
            for records in consumer.poll(timeout_ms=200).values():
                found.extend(records)
    finally:
        consumer.close()
    return found


def test_served_from_the_champion_with_a_signed_exposure_on_the_raw_topic(
    running: Running, registry: tuple[str, str, dict[str, str]]
) -> None:
    _, name, versions = registry
    running.wait_ready()
    body = running.complete("alice", request_id="req-1", max_tokens=8)
    assert body["model"] == {"name": name, "version": versions["good1"]} and body["arm"] == "stable"
    assert 1 <= len(body["completion_tokens"]) <= 8
    assert len(body["logprobs"]) == len(body["completion_tokens"])
    assert all(lp <= 0 for lp in body["logprobs"])
    [rec] = raw_records(running.settings, 1)
    assert rec.key == b"req-1"
    running.parts[3].flush()
    req, err, by_user = read_counts(make_redis(running.settings.redis), running.settings.redis.key_prefix,
                                    {"stable": versions["good1"]}, since_ts=time.time() - 60)
    assert (req, err, by_user) == ({"stable": 1}, {"stable": 0}, {"stable": []}), \
        "the judge's request counts are in Redis"
    assert authenticate(rec.value, rec.headers, AuthPolicy(keys={"gateway": SECRET.encode()})) is None
    event = parse_event(rec.value)
    assert isinstance(event, CompletionServed)
    assert event.request_id == "req-1" and event.user_key == "alice" and event.arm == "stable"
    assert event.model.version == versions["good1"] and event.prompt_tokens == [0, 5, 9]
    assert event.completion_tokens == body["completion_tokens"] and event.logprobs == body["logprobs"]
    assert event.latency_ms == body["latency_ms"] and event.completion_kind == body["completion_kind"]


def test_http_errors(running: Running) -> None:
    running.wait_ready()
    assert running.request("GET", "/nowhere")[0] == 404
    assert running.request("GET", "/v1/completions")[0] == 405
    code, body = running.request("POST", "/v1/completions", b'{"user_key": ')
    assert code == 400 and body["error"]["message"].startswith("malformed JSON")
    code, body = running.request("POST", "/v1/completions", b"x" * (64 * 1024 + 1))
    assert code == 413 and "exceeds" in body["error"]["message"]
    # the server closed that connection; the client reconnects and keeps going
    assert running.complete("bob")["arm"] == "stable"
    assert running.request("GET", "/metrics")[0] == 200
    assert running.request("GET", "/healthz")[0] == 200


def test_weight_change_in_redis_moves_users_within_seconds(
    running: Running, registry: tuple[str, str, dict[str, str]]
) -> None:
    _, _, versions = registry
    v1, v2 = versions["good1"], versions["good2"]
    set_routing(running.settings, stable_version=v1, canary_version=v2, canary_weight="0", salt="salt-a")
    running.wait_ready()
    users = [f"user-{i}" for i in range(30)]
    deadline = time.monotonic() + 10
    while running.gateway.slots.get("canary") is None:
        assert time.monotonic() < deadline, "canary never loaded"
        time.sleep(0.05)
    assert {running.complete(u)["arm"] for u in users} == {"stable"}

    set_routing(running.settings, canary_weight="0.5")
    changed_at = time.monotonic()
    expected = {u: assign_arm(u, "salt-a", 0.5) for u in users}
    assert "canary" in expected.values() and "stable" in expected.values()
    while running.request("GET", "/v1/routing")[1]["canary_weight"] != 0.5:
        assert time.monotonic() - changed_at < 3.0, "weight change not applied within 3 s"
        time.sleep(0.05)
    assert {u: running.complete(u)["arm"] for u in users} == expected
    body = running.complete(next(u for u, a in expected.items() if a == "canary"))
    assert body["model"]["version"] == v2
    code, routing = running.request("GET", "/v1/routing")
    assert code == 200 and routing == {"canary_weight": 0.5, "stable": {"version": v1},
                                       "canary": {"version": v2}, "salt": "salt-a", "holdout": None}


def test_canary_that_fails_to_load_is_served_by_stable_and_counted(
    running: Running, registry: tuple[str, str, dict[str, str]]
) -> None:
    _, _, versions = registry
    v1, bad = versions["good1"], versions["broken"]
    failed_before = GATEWAY_MODEL_LOADS.labels("canary", "failed")._value.get()
    errors_before = GATEWAY_ERRORS.labels("canary", bad, "load")._value.get()
    set_routing(running.settings, stable_version=v1, canary_version=bad, canary_weight="1", salt="s")
    running.wait_ready()
    deadline = time.monotonic() + 15
    while GATEWAY_MODEL_LOADS.labels("canary", "failed")._value.get() == failed_before:
        assert time.monotonic() < deadline, "broken canary was never attempted"
        time.sleep(0.05)
    bodies = [running.complete(f"u{i}", request_id=f"fb-{i}") for i in range(5)]
    assert {(b["arm"], b["model"]["version"]) for b in bodies} == {("stable", v1)}
    assert GATEWAY_ERRORS.labels("canary", bad, "load")._value.get() == errors_before + 1
    events = [parse_event(r.value) for r in raw_records(running.settings, 5)]
    assert {(e.arm, e.model.version) for e in events} == {("stable", v1)}  # type: ignore[union-attr]


def test_broker_down_at_start_still_serves_and_counts_drops(
    settings: Settings, registry: tuple[str, str, dict[str, str]], tmp_path: Path
) -> None:
    from services.settings.model import KafkaSettings
    from services.stack.embedded import free_port

    dead = settings.model_copy(update={"kafka": KafkaSettings(bootstrap_servers=f"127.0.0.1:{free_port()}",
                                                              request_timeout_ms=1000)})
    gw = Running.__new__(Running)
    gw.settings = gateway_settings(dead, registry, exposure_queue=3)
    gw.health = Health()
    gw.gateway, gw.parts = build(gw.settings, gw.health)
    gw.server = GatewayServer(gw.gateway, "127.0.0.1", 0).start()
    gw.conn = http.client.HTTPConnection("127.0.0.1", gw.server.port, timeout=10)
    try:
        deadline = time.monotonic() + 20
        while gw.gateway.slots.get("stable") is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        dropped = GATEWAY_EXPOSURES.labels("dropped")._value.get()
        t0 = time.perf_counter()
        for i in range(6):
            gw.complete(f"u{i}")
        assert time.perf_counter() - t0 < 2.0
        deadline = time.monotonic() + 10  # counts come from the exposure process every 0.5 s
        while GATEWAY_EXPOSURES.labels("dropped")._value.get() < dropped + 3:  # its queue holds 3
            assert time.monotonic() < deadline, "dropped exposures were not counted"
            time.sleep(0.1)
        code, ready = gw.request("GET", "/readyz")  # it still answers: it stays in its Service
        assert code == 200 and ready["failing"] == [] and ready["degraded"] == ["broker"]
    finally:
        gw.conn.close()
        gw.server.stop()
        for part in gw.parts[:2]:
            part.stop()
        gw.parts[2].stop(timeout_s=0.5)
        gw.parts[3].stop()

