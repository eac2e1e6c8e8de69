"""The dedup contract (tests/unit/test_ingest_dedup.py) against a real Redis."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest

from ingest.adapters.redis_dedup import RedisDedupStore
from ingest.dedup import duplicates
from services.runtime.redis_io import make_redis
from services.settings.model import Settings


@pytest.fixture
def store(settings: Settings) -> Iterator[RedisDedupStore]:
    client = make_redis(settings.redis)
    yield RedisDedupStore(client, settings.redis.key_prefix, ttl_s=60)
    client.close()


def test_claims_and_duplicates(store: RedisDedupStore) -> None:
    assert store.claim_many([("e1", "raw:0:1"), ("e1", "raw:0:2"), ("e2", "raw:0:3")]) == [
        None, "raw:0:1", None,
    ]
    assert store.claim_many([("e1", "raw:3:9")]) == ["raw:0:1"]


def test_replay_of_itself_is_not_a_duplicate(store: RedisDedupStore) -> None:
    batch = [("a", "raw:0:10"), ("b", "raw:0:11"), ("a", "raw:0:12")]
    assert duplicates(store, batch) == [False, False, True]
    assert duplicates(store, batch) == [False, False, True]
    assert duplicates(store, [("b", "raw:2:5")]) == [True]


def test_forget_and_ttl(settings: Settings) -> None:
    client = make_redis(settings.redis)
    try:
        st = RedisDedupStore(client, settings.redis.key_prefix, ttl_s=1)
        eid = uuid.uuid4().hex
        st.claim_many([(eid, "m1")])
        assert 0 < int(client.ttl(st.key(eid))) <= 1
        st.forget(eid)
        assert st.claim_many([(eid, "m2")]) == [None]
        time.sleep(1.2)
        assert st.claim_many([(eid, "m3")]) == [None], "an expired id is claimable again"
    finally:
        client.close()


def test_two_thousand_claims_in_one_call(store: RedisDedupStore) -> None:
    claims = [(f"id-{i}", f"raw:1:{i}") for i in range(2000)]
    t0 = time.perf_counter()
    assert store.claim_many(claims) == [None] * 2000
    assert time.perf_counter() - t0 < 2.0


def test_cluster_fallback_answers_like_the_script(settings: Settings) -> None:
    """The MULTI/EXEC fallback (used where a Cluster refuses multi-slot scripts) gives
    exactly the script's answers on the same sequence of batches."""
    client = make_redis(settings.redis)
    try:
        scripted = RedisDedupStore(client, settings.redis.key_prefix + "s:", ttl_s=60)
        piped = RedisDedupStore(client, settings.redis.key_prefix + "p:", ttl_s=60)
        piped._scripted = False
        batches = [
            [("x", "raw:0:1"), ("y", "raw:0:2"), ("x", "raw:0:3")],
            [("y", "raw:1:7"), ("z", "raw:1:8")],
            [("x", "raw:0:1")],
        ]
        for batch in batches:
            assert scripted.claim_many(batch) == piped.claim_many(batch)
        assert scripted.claim_many([("x", "raw:9:9")]) == ["raw:0:1"]
    finally:
        client.close()
