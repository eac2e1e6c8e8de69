"""Transactional ids per replica generation (services/runtime/transactions.py, with the
ingest and reward id schemes), on fakeredis."""

from __future__ import annotations

import fakeredis

from services.runtime.transactions import TransactionalIds, unique_transactional_id
from services.wiring.ingest import transactional_ids
from services.wiring.reward import transactional_ids as reward_transactional_ids


def test_unique_per_process_without_instance_id() -> None:
    a, b = unique_transactional_id("ingest", "g"), unique_transactional_id("ingest", "g")
    assert a != b and a.startswith("rtrl-ingest.g.")


def test_each_start_takes_a_new_generation_and_fences_the_last() -> None:
    ids = transactional_ids(fakeredis.FakeRedis(), "p:", "g", "w0")
    first, stale = ids.next()
    assert (first, stale) == ("rtrl-ingest.g.w0.1", [])
    ids.fenced(first)
    second, stale = ids.next()
    assert (second, stale) == ("rtrl-ingest.g.w0.2", ["rtrl-ingest.g.w0.1"])


def test_a_start_that_died_before_fencing_leaves_its_predecessor_to_the_next() -> None:
    ids = transactional_ids(fakeredis.FakeRedis(), "p:", "g", "w0")
    ids.fenced(ids.next()[0])  # generation 1 ran
    ids.next()  # generation 2 died before fencing 1
    third, stale = ids.next()
    assert third.endswith(".3")
    assert stale == ["rtrl-ingest.g.w0.1", "rtrl-ingest.g.w0.2"]


def test_fencing_is_bounded_and_replicas_are_independent() -> None:
    r = fakeredis.FakeRedis()
    ids = transactional_ids(r, "p:", "g", "w0")
    for _ in range(30):
        ids.next()
    _, stale = ids.next()
    assert len(stale) == TransactionalIds.KEEP
    assert transactional_ids(r, "p:", "g", "w1").next() == ("rtrl-ingest.g.w1.1", [])


def test_the_reward_scheme_keeps_its_ids_and_counter() -> None:
    """Reward ids stay ``<base>-<n>`` under ``reward:txgen:<base>``, so an upgraded worker
    continues the generations of the one it replaces instead of reusing its ids."""
    r = fakeredis.FakeRedis()
    r.set("p:reward:txgen:reward-0", 7)  # written by the worker before the upgrade
    ids = reward_transactional_ids(r, "p:", "reward-0")
    txn_id, stale = ids.next()
    assert txn_id == "reward-0-8" and stale == [f"reward-0-{g}" for g in range(1, 8)]
    ids.fenced(txn_id)
    assert ids.next() == ("reward-0-9", ["reward-0-8"])
