"""Per (version, arm) request/error counts the judge's error-rate guardrail reads."""

from __future__ import annotations

import json
from typing import Any

import fakeredis

from deployer.adapters.served_counts import (
    BUCKET_S,
    MAX_USER_FIELDS,
    ServedCounts,
    read_counts,
    served_key,
    sum_since,
)
from deployer.routing import RoutingTable
from services.gateway.models import ModelSlots
from services.gateway.server import Gateway
from services.settings.services import GatewaySettings
from tests.unit.test_gateway_core import REQ, FakeBackend


def counted_gateway(stable: Any, canary: Any, weight: float) -> tuple[Gateway, list[tuple[Any, ...]]]:
    backends = {"1": stable, "2": canary}
    slots = ModelSlots(lambda _arm, version: backends[version])  # type: ignore[arg-type,return-value]
    slots.want("1", "2" if canary else None)
    slots.step()
    table = RoutingTable(weight, "salt", "1", "2" if canary else None)
    seen: list[tuple[Any, ...]] = []
    gw = Gateway(GatewaySettings(allow_anonymous=True), slots, lambda: table, lambda _e: None, "rtrl-policy",
                 count=lambda v, a, e, u=None: seen.append((v, a, e) if u is None else (v, a, e, u)))
    return gw, seen


def post(gw: Gateway, user: str) -> int:
    return gw.handle("POST", "/v1/completions", json.dumps({**REQ, "user_key": user}).encode()).code


def test_success_failure_and_canary_fallback_are_counted_by_assignment() -> None:
    gw, seen = counted_gateway(FakeBackend(), FakeBackend(fail=RuntimeError("boom")), weight=1.0)
    assert post(gw, "a") == 200  # canary raised, stable served
    assert seen == [("2", "canary", True, "a")], "a canary failure is the canary cohort's error, by user"
    gw, seen = counted_gateway(FakeBackend(), None, weight=0.0)
    assert post(gw, "b") == 200
    assert seen == [("1", "stable", False)]
    gw, seen = counted_gateway(FakeBackend(fail=RuntimeError("down")), None, weight=0.0)
    assert post(gw, "c") == 500
    assert seen == [("1", "stable", True, "c")]
    gw, seen = counted_gateway(FakeBackend(), None, weight=0.0)
    bad = gw.handle("POST", "/v1/completions", b"{not json").code
    assert bad == 400 and seen == [], "client errors are not the model's errors"


def test_sum_since_counts_only_buckets_from_the_start_on() -> None:
    fields = {b"r:10": b"5", b"e:10": b"1", b"r:11": b"7", b"e:11": b"2", b"r:9": b"100", b"x:11": b"3"}
    assert sum_since(fields, since_ts=10 * BUCKET_S + 3) == (12, 3)
    assert sum_since(fields, since_ts=0) == (112, 3)
    assert sum_since({}, since_ts=0) == (0, 0)


def test_flush_accumulates_in_redis_and_reads_back_per_arm() -> None:
    client = fakeredis.FakeRedis()
    now = [1000.0]
    counts = ServedCounts(client, "p:", clock=lambda: now[0])
    for _ in range(3):
        counts.count("7", "canary", error=False)
    counts.count("7", "canary", error=True, user="alice")
    counts.count("6", "stable", error=False)
    counts.flush()
    counts.count("7", "canary", error=True, user="alice")
    counts.flush()
    now[0] = 5000.0
    counts.count("7", "canary", error=False)  # a later bucket
    counts.flush()
    assert client.ttl(served_key("p:", "7", "canary")) > 0
    req, err, users = read_counts(client, "p:", {"stable": "6", "canary": "7"}, since_ts=990.0)
    assert req == {"stable": 1, "canary": 6} and err == {"stable": 0, "canary": 2}
    assert users == {"stable": [], "canary": [("alice", 1000.0, 2)]}  # both errors: one user, one bucket
    req, err, users = read_counts(client, "p:", {"stable": "6", "canary": "7"}, since_ts=4000.0)
    assert req == {"stable": 0, "canary": 1} and err == {"stable": 0, "canary": 0}
    assert users == {"stable": [], "canary": []}


def test_errors_by_user_keep_any_user_key_and_stay_bounded() -> None:
    client = fakeredis.FakeRedis()
    counts = ServedCounts(client, "p:", clock=lambda: 100.0)
    counts.count("7", "canary", error=True, user="team:a:b")  # colons in a key survive
    counts.count("7", "canary", error=True)  # no user known: counted, not attributed
    for u in range(MAX_USER_FIELDS + 50):
        counts.count("8", "canary", error=True, user=f"u{u}")
    counts.flush()
    _, err, users = read_counts(client, "p:", {"canary": "7"}, 0.0)
    assert err == {"canary": 2} and users == {"canary": [("team:a:b", 100.0, 1)]}
    _, err, users = read_counts(client, "p:", {"canary": "8"}, 0.0)
    assert err == {"canary": MAX_USER_FIELDS + 50} and len(users["canary"]) == MAX_USER_FIELDS


def test_counts_survive_a_failed_flush() -> None:
    class Down:
        def pipeline(self, transaction: bool = False) -> Any:
            raise ConnectionError("redis down")

    counts = ServedCounts(Down(), "p:", clock=lambda: 0.0)
    counts.count("1", "stable", error=True)
    counts.flush()
    client = fakeredis.FakeRedis()
    counts._client = client
    counts.flush()
    assert read_counts(client, "p:", {"stable": "1"}, 0.0) == ({"stable": 1}, {"stable": 1}, {"stable": []})
