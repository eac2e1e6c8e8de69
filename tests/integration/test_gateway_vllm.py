"""rtrl in front of a real vLLM engine, as a team would run it: the official ``openai`` client
talks to the gateway (chat and completions, streamed or not), the gateway forwards to vLLM,
and the exposure event on the raw topic carries exactly the engine's token ids and
log-probabilities. The deployer loads a LoRA candidate into the engine before it serves,
rolls it back and unloads it; a corrupt adapter never receives traffic.
"""

from __future__ import annotations

import http.client
import json
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI
from pydantic import SecretStr

from deployer.adapters.mlflow_registry import MlflowRegistry
from deployer.controller import Controller
from deployer.ledger import TAG_GATE, TAG_REASON
from deployer.operators import sign
from deployer.status import Command, Phase
from ingest.contracts.keys import engine_model_key
from ingest.events import CompletionServed, parse_event
from services.gateway.asgi.app import GatewayServer
from services.runtime.health import Health
from services.runtime.kafka_io import ensure_topics, make_consumer
from services.runtime.redis_io import make_redis
from services.settings.engine import EngineSettings
from services.settings.model import Settings
from services.settings.services import GatewaySettings
from services.stack.tiny_llm import write_engine_check
from services.wiring.deployer import build_controller, build_ports
from services.wiring.gateway import build
from tests.integration.conftest import Engine
from tests.integration.deployer_helpers import deployer_settings, with_operators
from trainer.lora_policy import check_prompt_ids

pytestmark = pytest.mark.integration

KEY = "sk-vllm-test"


class Served:
    """A gateway in front of the engine, with an OpenAI client and a reader of its exposures."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        ensure_topics(settings, [settings.topics.raw])
        self.gateway, self.parts = build(settings, Health())
        self.server = GatewayServer(self.gateway, "127.0.0.1", 0).start()
        self.client = OpenAI(base_url=f"http://127.0.0.1:{self.server.port}/v1", api_key=KEY, max_retries=0)
        self.consumer = make_consumer(settings.kafka, None, [settings.topics.raw])
        self.seen: dict[str, CompletionServed] = {}

    def exposure(self, request_id: str, timeout_s: float = 20.0) -> CompletionServed:
        deadline = time.monotonic() + timeout_s
        while request_id not in self.seen:
            assert time.monotonic() < deadline, f"no exposure for {request_id}"
            for batch in self.consumer.poll(timeout_ms=200).values():
                for rec in batch:
                    event = parse_event(rec.value)
                    if isinstance(event, CompletionServed):
                        self.seen[event.request_id] = event
        return self.seen[request_id]

    def stop(self) -> None:
        self.server.stop()
        for part in self.parts:
            part.stop()
        self.consumer.close()


def engine_settings(settings: Settings, engine: Engine, tmp: Path, mlflow_uri: str) -> Settings:
    s = deployer_settings(settings, mlflow_uri)
    return s.model_copy(update={
        "engine": EngineSettings(kind="vllm", base_url=engine.base_url, base_model=engine.model,
                                 adapter_dir=tmp / "adapters"),
        "gateway": GatewaySettings(port=0, routing_poll_s=0.2, load_retry_s=0.5, champion_refresh_s=0.5,
                                   key_id="gateway", secret=SecretStr("s"), api_keys={"t": SecretStr(KEY)}),
    })


def direct(engine: Engine, path: str, body: dict[str, Any]) -> dict[str, Any]:
    host, port = engine.base_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = json.loads(resp.read())
    conn.close()
    assert resp.status == 200, data
    return data


def assert_same(event: CompletionServed, answer: dict[str, Any], kind: str) -> None:
    """The exposure holds the engine's own ids and log-probabilities (a direct call, same seed)."""
    choice = answer["choices"][0]
    prompt = answer.get("prompt_token_ids") or choice.get("prompt_token_ids")
    assert event.prompt_tokens == prompt
    assert event.completion_tokens == choice["token_ids"]
    lps = ([c["logprob"] for c in choice["logprobs"]["content"]] if kind == "chat"
           else choice["logprobs"]["token_logprobs"])
    assert event.logprobs == pytest.approx(lps, abs=1e-5)


@pytest.fixture
def served(settings: Settings, vllm_engine: Engine, tmp_path: Path, mlflow_uri: str) -> Iterator[Served]:
    s = Served(engine_settings(settings, vllm_engine, tmp_path, mlflow_uri))
    deadline = time.monotonic() + 30
    while s.gateway.slots.get("stable") is None:
        assert time.monotonic() < deadline, "the gateway never served the engine's base model"
        time.sleep(0.2)
    yield s
    s.stop()


MESSAGES = [{"role": "user", "content": "Please fix the loop."}]


def test_chat_through_the_gateway_logs_the_engines_tokens_and_logprobs(served: Served,
                                                                        vllm_engine: Engine) -> None:
    name = served.settings.mlflow.registered_model
    assert [m.id for m in served.client.models.list().data] == [name]
    r = served.client.chat.completions.create(model=name, messages=MESSAGES, user="u-1", max_tokens=6,
                                              seed=7, temperature=1.0)
    extra = r.model_extra or {}
    ext = extra["rtrl"]
    assert ext == {"request_id": r.id, "arm": "stable", "version": "base",
                   "latency_ms": served.exposure(r.id).latency_ms}
    assert r.usage is not None and r.usage.completion_tokens == len(served.exposure(r.id).completion_tokens)
    want = direct(vllm_engine, "/v1/chat/completions", {
        "model": vllm_engine.model, "messages": MESSAGES, "max_tokens": 6, "seed": 7, "temperature": 1.0,
        "top_p": 1.0, "logprobs": True, "top_logprobs": 0, "return_token_ids": True})
    event = served.exposure(r.id)
    assert_same(event, want, "chat")
    assert r.choices[0].message.content == want["choices"][0]["message"]["content"]
    assert event.user_key == "u-1" and event.arm == "stable" and event.model.version == "base"


def test_streamed_chat_is_relayed_and_logged_like_the_whole_answer(served: Served,
                                                                   vllm_engine: Engine) -> None:
    name = served.settings.mlflow.registered_model
    stream = served.client.chat.completions.create(
        model=name, messages=MESSAGES, user="u-2", max_tokens=8, seed=11, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    rid = chunks[0].id
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
    want = direct(vllm_engine, "/v1/chat/completions", {
        "model": vllm_engine.model, "messages": MESSAGES, "max_tokens": 8, "seed": 11, "temperature": 1.0,
        "top_p": 1.0, "logprobs": True, "top_logprobs": 0, "return_token_ids": True})
    assert text == want["choices"][0]["message"]["content"]
    assert_same(served.exposure(rid), want, "chat")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("prompt", ["def add(a, b):", [5, 6, 7, 8]])
def test_completions_with_text_or_token_prompts(served: Served, vllm_engine: Engine, stream: bool,
                                                prompt: str | list[int]) -> None:
    name = served.settings.mlflow.registered_model
    args: dict[str, Any] = {"model": name, "prompt": prompt, "user": "u-3", "max_tokens": 5, "seed": 3}
    if stream:
        chunks = list(served.client.completions.create(**args, stream=True))
        rid, text = chunks[0].id, "".join(c.choices[0].text for c in chunks if c.choices)
    else:
        r = served.client.completions.create(**args)
        rid, text = r.id, r.choices[0].text
    want = direct(vllm_engine, "/v1/completions", {
        "model": vllm_engine.model, "prompt": prompt, "max_tokens": 5, "seed": 3, "temperature": 1.0,
        "top_p": 1.0, "logprobs": 1, "return_token_ids": True})
    assert text == want["choices"][0]["text"]
    assert_same(served.exposure(rid), want, "completion")


def test_the_token_id_api_works_on_the_engine(served: Served) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", served.server.port, timeout=30)
    body = {"user_key": "u-4", "session_id": "s", "prompt_tokens": [5, 6, 7], "max_tokens": 4,
            "request_id": "tok-1"}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Authorization": f"Bearer {KEY}"})
    resp = conn.getresponse()
    out = json.loads(resp.read())
    assert resp.status == 200 and len(out["completion_tokens"]) == len(out["logprobs"]) > 0
    assert served.exposure("tok-1").completion_tokens == out["completion_tokens"]


# ------------------------------------------------------------------ candidates on the engine


def register(reg: MlflowRegistry, tmp: Path, engine: Engine, name: str, adapter: Path | None,
             base: bool = False) -> str:
    """A version as the deployer reads it: policy.json, adapter/, engine_check.json."""
    d = tmp / name
    d.mkdir()
    (d / "policy.json").write_text(json.dumps({"kind": "hf", **({"engine": "base"} if base else {})}))
    if adapter is not None:
        shutil.copytree(adapter, d / "adapter")
    ids = check_prompt_ids(engine.model_dir)
    good = None if base else engine.adapter(1)  # a corrupt adapter's own reference is the good one's
    write_engine_check(d, engine.model_dir, good, ids)
    return reg.register(None, d, tags={TAG_GATE: "pass", "rtrl.parent_version": "1"})


def step_until(controller: Controller, phases: set[Phase], timeout_s: float = 60) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        status = controller.step()
        assert status is not None
        if status.phase in phases:
            return status
        assert time.monotonic() < deadline, f"stuck in {status.phase}: {status.note}"
        time.sleep(0.2)


def engine_models(engine: Engine) -> set[str]:
    host, port = engine.base_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("GET", "/v1/models")
    data = json.loads(conn.getresponse().read())
    conn.close()
    return {m["id"] for m in data["data"]}


@contextmanager
def live_traffic(engine: Engine, workers: int = 3) -> Iterator[list[int]]:
    """Requests to the engine's base model from ``workers`` threads until the block ends;
    yields the answers' status codes (what production traffic looks like to the engine)."""
    codes: list[int] = []
    stop = threading.Event()
    host, port = engine.base_url.removeprefix("http://").split(":")

    def send() -> None:
        while not stop.is_set():
            conn = http.client.HTTPConnection(host, int(port), timeout=30)
            try:
                conn.request("POST", "/v1/chat/completions", json.dumps(
                    {"model": "tiny-base", "messages": MESSAGES, "max_tokens": 6}),
                    {"Content-Type": "application/json"})
                resp = conn.getresponse()
                resp.read()
                codes.append(resp.status)
            except OSError:
                codes.append(0)
            finally:
                conn.close()

    threads = [threading.Thread(target=send, daemon=True) for _ in range(workers)]
    for t in threads:
        t.start()
    try:
        yield codes
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)


def test_a_lora_candidate_is_loaded_before_traffic_serves_the_canary_and_is_unloaded(
        served: Served, vllm_engine: Engine, tmp_path: Path) -> None:
    s = served.settings
    reg = MlflowRegistry(s.mlflow.tracking_uri, s.mlflow.registered_model)
    assert register(reg, tmp_path, vllm_engine, "v1", None, base=True) == "1"
    reg.set_alias("champion", "1")
    assert register(reg, tmp_path, vllm_engine, "v2", vllm_engine.adapter(1)) == "2"
    reg.set_alias("candidate", "2")
    ports = build_ports(s)
    s, tokens = with_operators(s, tmp_path, "test")  # the deployer verifies the operator's rollback
    controller = build_controller(s, ports, None)
    # loaded and checked while the engine serves other requests in the same batches (vLLM's
    # CPU engine dies on a LoRA prompt_logprobs request batched with others: the check is greedy)
    with live_traffic(vllm_engine) as codes:
        status = step_until(controller, {Phase.PROGRESSING})  # only once loaded and checked
        time.sleep(1.0)
    assert codes and set(codes) == {200}, f"the engine failed while checking the candidate: {codes}"
    lora = f"{s.mlflow.registered_model}-v2"
    assert lora in engine_models(vllm_engine) and status.weight > 0
    r = make_redis(s.redis)
    assert r.get(engine_model_key(s.redis.key_prefix, "2")) == lora.encode()
    # canary users are served by the adapter, with its own logprobs
    name = s.mlflow.registered_model
    canary = None
    for i in range(200):
        resp = served.client.chat.completions.create(model=name, messages=MESSAGES, user=f"c-{i}",
                                                     max_tokens=4, seed=5)
        if (resp.model_extra or {})["rtrl"]["arm"] == "canary":
            canary = resp
            break
    assert canary is not None, "no user reached the canary"
    event = served.exposure(canary.id)
    assert event.arm == "canary" and event.model.version == "2"
    want = direct(vllm_engine, "/v1/chat/completions", {
        "model": lora, "messages": MESSAGES, "max_tokens": 4, "seed": 5, "temperature": 1.0, "top_p": 1.0,
        "logprobs": True, "top_logprobs": 0, "return_token_ids": True})
    assert_same(event, want, "chat")
    # rollback: the adapter is unloaded and its record removed
    token = tokens["test"].read_text().strip()
    ports.state.push(sign(Command("rb-1", "rollback", "test", reason="test rollback"), token, time.time()))
    step_until(controller, {Phase.ROLLED_BACK})
    controller.step()
    assert lora not in engine_models(vllm_engine)
    assert r.get(engine_model_key(s.redis.key_prefix, "2")) is None


def offered(served: Served, engine: Engine, tmp_path: Path,
            adapter: Path) -> tuple[Settings, MlflowRegistry, Controller]:
    """The base model as champion v1 and ``adapter`` (checked as adapter 1) as candidate v2."""
    s = served.settings
    reg = MlflowRegistry(s.mlflow.tracking_uri, s.mlflow.registered_model)
    register(reg, tmp_path, engine, "v1", None, base=True)
    reg.set_alias("champion", "1")
    register(reg, tmp_path, engine, "v2", adapter)
    reg.set_alias("candidate", "2")
    return s, reg, build_controller(s, build_ports(s), None)


def test_an_adapter_unlike_the_candidates_own_fails_the_check(
        served: Served, vllm_engine: Engine, tmp_path: Path) -> None:
    """Adapter 2 under the check written for adapter 1: loadable, but not the candidate."""
    s, _, controller = offered(served, vllm_engine, tmp_path, vllm_engine.adapter(2))
    status = step_until(controller, {Phase.ROLLED_BACK, Phase.PROGRESSING})
    assert status.phase == Phase.ROLLED_BACK and status.weight == 0.0
    assert "the engine is not serving this model" in status.reason, status.reason
    assert f"{s.mlflow.registered_model}-v2" not in engine_models(vllm_engine)


def test_a_corrupt_adapter_is_rolled_back_and_never_receives_traffic(
        served: Served, vllm_engine: Engine, tmp_path: Path) -> None:
    s, reg, controller = offered(served, vllm_engine, tmp_path, vllm_engine.corrupt(1))
    weights = []
    deadline = time.monotonic() + 60
    while True:
        status = controller.step()
        assert status is not None
        weights.append(status.weight)
        if status.phase == Phase.ROLLED_BACK or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert status.phase == Phase.ROLLED_BACK and set(weights) == {0.0}
    assert status.reason.startswith("engine: the engine refused the adapter")
    assert "engine: " in reg.get_tags("2")[TAG_REASON]
    assert f"{s.mlflow.registered_model}-v2" not in engine_models(vllm_engine)
    deadline = time.monotonic() + 30  # the champion, loaded by the deployer, replaces "base"
    while (served.gateway.slots.get("stable") or ("",))[0] != "1":
        assert time.monotonic() < deadline, served.gateway.slots.get("stable")
        time.sleep(0.2)
    for i in range(20):  # everyone is served by the champion (the base model)
        resp = served.client.chat.completions.create(model=s.mlflow.registered_model, messages=MESSAGES,
                                                     user=f"x-{i}", max_tokens=2)
        assert (resp.model_extra or {})["rtrl"]["version"] == "1"
