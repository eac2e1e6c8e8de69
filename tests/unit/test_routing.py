from __future__ import annotations

import hashlib
import itertools

import pytest

from deployer.routing import (
    BUCKETS,
    RoutingTable,
    assign_arm,
    bucket,
    canary_buckets,
    clamp_weight,
    parse_table,
)
from ingest.contracts.keys import routing_keys

USERS = [f"user-{i}" for i in range(4000)]


def reference_bucket(user_key: str, salt: str) -> int:
    """The documented formula, written out plainly."""
    h = hashlib.sha256()
    h.update(salt.encode())
    h.update(user_key.encode())
    value = 0
    for byte in h.digest()[:8]:
        value = value * 256 + byte
    return value % 10_000


def test_bucket_matches_the_documented_formula() -> None:
    for user in USERS[:500]:
        assert bucket(user, "s1") == reference_bucket(user, "s1")
    # by hand: sha256(b"ab") starts fb8e20fc2e4c3f24
    assert bucket("b", "a") == int("fb8e20fc2e4c3f24", 16) % 10_000 == bucket("ab", "")


def test_weight_edges() -> None:
    assert all(assign_arm(u, "s", 0.0) == "stable" for u in USERS)
    assert all(assign_arm(u, "s", 1.0) == "canary" for u in USERS)
    assert all(assign_arm(u, "s", float("nan")) == "stable" for u in USERS[:100])
    assert clamp_weight(-0.5) == 0.0 and clamp_weight(7.0) == 1.0


def test_threshold_is_exactly_the_bucket_cutoff() -> None:
    for user in USERS[:300]:
        b = bucket(user, "x")
        assert assign_arm(user, "x", b / BUCKETS) == "stable"  # bucket < b is false
        assert assign_arm(user, "x", (b + 1) / BUCKETS) == "canary"


def test_canary_buckets_rounds_decimal_weights_exactly() -> None:
    weights = (0.0, 0.01, 0.07, 0.29, 0.57, 1.0)
    assert [canary_buckets(w) for w in weights] == [0, 100, 700, 2900, 5700, 10_000]
    assert 0.07 * BUCKETS > 700 and 0.57 * BUCKETS < 5700  # what rounding protects against


def test_sticky() -> None:
    first = [assign_arm(u, "salt", 0.3) for u in USERS]
    assert first == [assign_arm(u, "salt", 0.3) for u in USERS]


def test_raising_the_weight_only_moves_users_to_canary() -> None:
    weights = [0.0, 0.01, 0.05, 0.25, 0.5, 0.75, 1.0]
    arms = {w: {u: assign_arm(u, "salt-7", w) for u in USERS} for w in weights}
    for lo, hi in itertools.pairwise(weights):
        moved_back = [u for u in USERS if arms[lo][u] == "canary" and arms[hi][u] == "stable"]
        assert moved_back == []


@pytest.mark.parametrize("weight", [0.01, 0.05, 0.25, 0.5])
def test_share_close_to_weight(weight: float) -> None:
    share = sum(assign_arm(u, "salt-share", weight) == "canary" for u in USERS) / len(USERS)
    # binomial sd at n=4000 is <= 0.008; 4 sd
    assert abs(share - weight) < 0.032


def test_salt_reshuffles_the_canary_cohort() -> None:
    a = {u for u in USERS if assign_arm(u, "salt-a", 0.1) == "canary"}
    b = {u for u in USERS if assign_arm(u, "salt-b", 0.1) == "canary"}
    assert a and b and len(a & b) < 0.3 * len(a)


def test_parse_table_defaults_and_values() -> None:
    assert parse_table({}) == RoutingTable()
    t = parse_table({"canary_weight": b"0.25", "salt": b"s", "stable_version": b"3",
                     "canary_version": b" 4 "})
    assert t == RoutingTable(0.25, "s", "3", "4")
    assert parse_table({"canary_version": b""}).canary_version is None


@pytest.mark.parametrize("raw", [b"abc", b"1.5", b"-0.1", b"nan", b"inf"])
def test_parse_table_bad_weight_routes_nobody_to_canary(raw: bytes) -> None:
    t = parse_table({"canary_weight": raw, "canary_version": b"4"})
    assert t.canary_weight == 0.0 and len(t.problems) == 1
    assert all(t.arm_for(u, canary_available=True) == "stable" for u in USERS[:50])


def test_arm_for_needs_a_loaded_canary() -> None:
    t = RoutingTable(1.0, "s", "3", "4")
    assert t.arm_for("u", canary_available=True) == "canary"
    assert t.arm_for("u", canary_available=False) == "stable"
    assert RoutingTable(1.0, "s", "3", None).arm_for("u", canary_available=True) == "stable"


def test_routing_keys() -> None:
    assert routing_keys("rtrl:") == {
        "canary_weight": "rtrl:routing:canary_weight",
        "salt": "rtrl:routing:salt",
        "stable_version": "rtrl:routing:stable_version",
        "canary_version": "rtrl:routing:canary_version",
        "holdout": "rtrl:routing:holdout",
    }
