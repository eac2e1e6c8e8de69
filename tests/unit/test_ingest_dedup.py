"""Dedup contract, run against the in-memory fake and the Redis adapter on fakeredis
(the same contract runs against a real Redis in tests/integration/test_ingest_dedup_redis.py)."""

from __future__ import annotations

from collections.abc import Iterator

import fakeredis
import pytest

from ingest.adapters.memory import MemoryDedupStore
from ingest.adapters.redis_dedup import RedisDedupStore
from ingest.dedup import DedupStore, duplicates, is_duplicate, position_marker


@pytest.fixture(params=["memory", "fakeredis"])
def store(request: pytest.FixtureRequest) -> Iterator[DedupStore]:
    if request.param == "memory":
        yield MemoryDedupStore(ttl_s=60)
    else:
        yield RedisDedupStore(fakeredis.FakeRedis(), key_prefix="t:", ttl_s=60)


def test_marker_and_rule() -> None:
    assert position_marker("raw", 3, 17) == "raw:3:17"
    assert not is_duplicate(None, "raw:0:1")
    assert not is_duplicate("raw:0:1", "raw:0:1")  # a replay of itself
    assert is_duplicate("raw:0:1", "raw:0:2")


def test_first_sighting_then_duplicate(store: DedupStore) -> None:
    assert store.claim_many([("e1", "raw:0:1")]) == [None]
    assert store.claim_many([("e1", "raw:1:9")]) == ["raw:0:1"]
    assert duplicates(store, [("e1", "raw:1:9"), ("e2", "raw:1:10")]) == [True, False]


def test_duplicate_inside_one_batch(store: DedupStore) -> None:
    assert store.claim_many([("e1", "raw:0:1"), ("e1", "raw:0:2"), ("e3", "raw:0:3")]) == [
        None, "raw:0:1", None,
    ]


def test_replay_of_itself_is_not_a_duplicate(store: DedupStore) -> None:
    """A worker claims, then dies before its transaction commits: the batch is read again
    from the committed offset and must be forwarded, while a real copy is still dropped."""
    batch = [("a", "raw:0:10"), ("b", "raw:0:11"), ("a", "raw:0:12")]
    assert duplicates(store, batch) == [False, False, True]
    # crash: nothing committed; the same records come back at the same positions
    assert duplicates(store, batch) == [False, False, True]
    # a later copy of "b" from elsewhere is a duplicate
    assert duplicates(store, [("b", "raw:2:5")]) == [True]


def test_forget_readmits(store: DedupStore) -> None:
    store.claim_many([("e1", "raw:0:1")])
    store.forget("e1")
    assert store.claim_many([("e1", "raw:0:7")]) == [None]


def test_empty_batch(store: DedupStore) -> None:
    assert store.claim_many([]) == []


def test_memory_store_expires() -> None:
    now = [0.0]
    st = MemoryDedupStore(ttl_s=10, clock=lambda: now[0])
    st.claim_many([("e1", "m1")])
    now[0] = 9.9
    assert st.claim_many([("e1", "m2")]) == ["m1"]
    now[0] = 10.1
    assert st.claim_many([("e1", "m2")]) == [None]


def test_redis_store_sets_ttl_and_prefix() -> None:
    r = fakeredis.FakeRedis()
    st = RedisDedupStore(r, key_prefix="inst1:", ttl_s=3600)
    st.claim_many([("e1", "raw:0:1")])
    assert r.get("inst1:ingest:dedup:e1") == b"raw:0:1"
    assert 3590 < r.ttl("inst1:ingest:dedup:e1") <= 3600
    with pytest.raises(ValueError, match="positive"):
        RedisDedupStore(r, key_prefix="x", ttl_s=0)
