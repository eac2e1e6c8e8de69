"""Model slots, exposure logger, routing poller and upstream parsing, against fakes."""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import pytest

from deployer.routing import RoutingTable
from ingest.contracts.prometheus import DEPENDENCY_RETRIES, GATEWAY_EXPOSURES
from services.gateway.exposure import ExposureLogger
from services.gateway.generation import LOGPROB_FLOOR, UpstreamError
from services.gateway.models import Backend, Generation, ModelSlots
from services.gateway.routing import ChampionCache, RoutingPoller
from services.gateway.upstream import parse_completion, token_id


class Named:
    vocab_size = None

    def __init__(self, name: str) -> None:
        self.name = name

    def generate(self, prompt_tokens: Sequence[int], max_tokens: int, temperature: float) -> Generation:
        return Generation([], [])

    def close(self) -> None:
        pass


class Loader:
    def __init__(self, broken: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        self.broken = set(broken)
        self.loads: list[tuple[str, str]] = []

    def __call__(self, arm: str, version: str) -> Backend:
        self.loads.append((arm, version))
        if version in self.broken:
            raise RuntimeError(f"cannot load {version}")
        return Named(f"{arm}:{version}")


def versions(slots: ModelSlots) -> tuple[str | None, str | None]:
    s, c = slots.get("stable"), slots.get("canary")
    return (s[0] if s else None, c[0] if c else None)


def test_slots_load_and_promotion_reuses_the_canary() -> None:
    loader = Loader()
    slots = ModelSlots(loader)  # type: ignore[arg-type]
    slots.want("1", "2")
    assert versions(slots) == (None, None)  # nothing until the loader runs
    slots.step()
    assert versions(slots) == ("1", "2")
    slots.want("2", None)  # promotion: canary becomes stable
    assert versions(slots) == ("1", None)  # canary dropped at once, stable kept
    slots.step()
    assert versions(slots) == ("2", None) and loader.loads == [("stable", "1"), ("canary", "2")]


def test_canary_that_fails_to_load_stays_empty_and_is_retried_later() -> None:
    now = [0.0]
    loader = Loader(broken={"2"})
    slots = ModelSlots(loader, retry_s=30, clock=lambda: now[0])  # type: ignore[arg-type]
    slots.want("1", "2")
    slots.step()
    slots.step()
    assert versions(slots) == ("1", None) and loader.loads.count(("canary", "2")) == 1
    now[0] = 31.0
    loader.broken.clear()
    slots.step()
    assert versions(slots) == ("1", "2")


def test_stable_keeps_serving_while_the_new_version_fails() -> None:
    slots = ModelSlots(Loader(broken={"3"}))  # type: ignore[arg-type]
    slots.want("1", None)
    slots.step()
    slots.want("3", None)
    slots.step()
    assert versions(slots) == ("1", None) and slots.wanted("stable") == "3"
    slots.want(None, None)  # the table names nothing: keep the last stable
    assert versions(slots) == ("1", None)


def test_unshared_slots_load_per_arm() -> None:
    loader = Loader()
    slots = ModelSlots(loader, share_across_arms=False)  # type: ignore[arg-type]
    slots.want("1", None)
    slots.step()
    slots.want("1", "1")
    slots.step()
    assert loader.loads == [("stable", "1"), ("canary", "1")]


def test_background_loader_thread_picks_up_wants() -> None:
    slots = ModelSlots(Loader()).start(idle_s=0.05)  # type: ignore[arg-type]
    try:
        slots.want("7", None)
        deadline = time.monotonic() + 2
        while slots.get("stable") is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert versions(slots) == ("7", None)
    finally:
        slots.stop()


# ------------------------------------------------------------------ exposure logger


class FakeSender:
    def __init__(self) -> None:
        self.sent: list[Any] = []
        self.flushed = False

    def send(self, event: Any) -> None:
        self.sent.append(event)

    def flush(self, timeout: float | None = None) -> None:
        self.flushed = True

    def close(self, timeout: float | None = None) -> None:
        pass


def fields(i: int) -> dict[str, Any]:
    return {"event_id": f"e{i}", "request_id": f"r{i}", "ts": datetime.now(UTC), "session_id": "s",
            "user_key": "u", "model": {"name": "m", "version": "1"}, "arm": "stable",
            "prompt_tokens": [0], "completion_tokens": [5], "logprobs": [-1.0], "latency_ms": 1.0}


def test_exposures_are_sent_in_the_background_and_flushed_at_stop() -> None:
    sender = FakeSender()
    logger = ExposureLogger(lambda: sender).start()
    for i in range(5):
        assert logger.log(fields(i))
    logger.stop()
    assert [e.request_id for e in sender.sent] == [f"r{i}" for i in range(5)] and sender.flushed


def test_full_queue_drops_and_counts_without_blocking() -> None:
    def unreachable() -> FakeSender:
        raise ConnectionError("no broker")

    logger = ExposureLogger(unreachable, maxsize=3, retry_s=60).start()
    before = GATEWAY_EXPOSURES.labels("dropped")._value.get()
    t0 = time.perf_counter()
    results = [logger.log(fields(i)) for i in range(5)]
    assert time.perf_counter() - t0 < 0.05
    assert results == [True, True, True, False, False] and not logger.healthy
    assert GATEWAY_EXPOSURES.labels("dropped")._value.get() == before + 2
    logger.stop(timeout_s=0.5)
    assert GATEWAY_EXPOSURES.labels("dropped")._value.get() == before + 5


def test_invalid_event_is_counted_not_sent() -> None:
    sender = FakeSender()
    logger = ExposureLogger(lambda: sender).start()
    before = GATEWAY_EXPOSURES.labels("invalid")._value.get()
    logger.log({**fields(1), "logprobs": [0.5]})
    logger.stop()
    assert sender.sent == [] and GATEWAY_EXPOSURES.labels("invalid")._value.get() == before + 1


# ------------------------------------------------------------------ routing poller


class Source:
    def __init__(self) -> None:
        self.table: RoutingTable | Exception = RoutingTable(0.1, "s", None, "2")

    def read(self) -> RoutingTable:
        if isinstance(self.table, Exception):
            raise self.table
        return self.table


def test_poller_uses_the_champion_when_redis_names_no_stable_and_survives_redis_errors() -> None:
    source = Source()
    seen: list[tuple[str | None, str | None]] = []
    poller = RoutingPoller(source, lambda t, s: seen.append((s, t.canary_version)), lambda: "5")
    poller.poll_once()
    source.table = RoutingTable(0.2, "s", "6", "2")
    poller.poll_once()
    source.table = ConnectionError("redis down")
    retries = DEPENDENCY_RETRIES.labels("gateway", "redis")
    before = retries._value.get()
    kept = poller.poll_once()
    assert seen == [("5", "2"), ("6", "2"), ("6", "2")] and kept.canary_weight == 0.2
    assert retries._value.get() == before + 1  # on-call sees the gateway fail on Redis


def test_failed_exposures_and_champion_lookups_count_as_dependency_failures() -> None:
    kafka = DEPENDENCY_RETRIES.labels("gateway", "kafka")
    mlflow = DEPENDENCY_RETRIES.labels("gateway", "mlflow")
    k0, m0 = kafka._value.get(), mlflow._value.get()

    class Failing:
        def send(self, _event: object) -> None:
            raise TimeoutError("metadata not available after 60 s")

    logger = ExposureLogger(Failing, retry_s=60).start()  # type: ignore[arg-type]
    logger.log(fields(0))
    logger.stop(timeout_s=1.0)
    assert kafka._value.get() == k0 + 1

    def lookup() -> str:
        raise ConnectionError("registry down")

    ChampionCache(lookup, refresh_s=0.0).get()
    assert mlflow._value.get() == m0 + 1


def test_champion_cache_refreshes_at_most_every_interval() -> None:
    calls: list[int] = []

    def lookup() -> str:
        calls.append(1)
        return "3"

    cache = ChampionCache(lookup, refresh_s=60)
    assert [cache.get() for _ in range(5)] == ["3"] * 5 and len(calls) == 1


# ------------------------------------------------------------------ upstream parsing


def test_token_ids() -> None:
    assert token_id("token_id:42", "require") == 42
    with pytest.raises(UpstreamError, match="return_tokens_as_token_ids"):
        token_id("hello", "require")
    h = token_id("hello", "hash")
    assert h == token_id("hello", "hash") and 0 <= h < 2**31 and h != token_id("world", "hash")


def test_parse_completion_cleans_logprobs() -> None:
    data = {"choices": [{"text": "ab", "logprobs": {
        "tokens": ["token_id:5", "token_id:6", "token_id:1"],
        "token_logprobs": [-0.25, None, 1e-9]}}]}
    gen = parse_completion(data, "require")
    assert gen.tokens == [5, 6, 1] and gen.logprobs == [-0.25, LOGPROB_FLOOR, 0.0]


@pytest.mark.parametrize("data", [{}, {"choices": []}, {"choices": [{"text": "x"}]},
                                  {"choices": [{"logprobs": None}]}])
def test_parse_completion_without_logprobs_is_502(data: Any) -> None:
    with pytest.raises(UpstreamError) as info:
        parse_completion(data, "hash")
    assert info.value.status == 502


def test_policy_backend_serves_no_empty_answer_with_min_tokens() -> None:
    import torch

    from services.gateway.models import PolicyBackend
    from trainer.policy import TinyConfig, TinyTransformer
    from trainer.tokens import BOS, EOS

    policy = TinyTransformer(TinyConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, max_len=32))
    with torch.no_grad():  # EOS is the overwhelming choice at every position
        policy.ln_f.weight.zero_()
        policy.ln_f.bias.zero_()
        policy.ln_f.bias[0] = 1.0
        policy.head.weight.zero_()
        policy.head.weight[EOS, 0] = 50.0
    assert PolicyBackend(policy).generate([BOS, 4], 8, 1.0).tokens == [EOS]
    gen = PolicyBackend(policy, min_tokens=1).generate([BOS, 4], 8, 1.0)
    assert len(gen.tokens) == 2 and gen.tokens[0] != EOS and gen.tokens[1] == EOS
