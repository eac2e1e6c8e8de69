"""Transactional ids per replica generation (services/serve_ingest.py), on fakeredis."""

from __future__ import annotations

import fakeredis

from services.serve_ingest import TransactionalIds, transactional_id


def test_unique_per_process_without_instance_id() -> None:
    a, b = transactional_id("g", None), transactional_id("g", None)
    assert a != b and a.startswith("rtrl-ingest.g.")


def test_each_start_takes_a_new_generation_and_fences_the_last() -> None:
    ids = TransactionalIds(fakeredis.FakeRedis(), "p:", "g", "w0")
    first, stale = ids.next()
    assert (first, stale) == ("rtrl-ingest.g.w0.1", [])
    ids.fenced(first)
    second, stale = ids.next()
    assert (second, stale) == ("rtrl-ingest.g.w0.2", ["rtrl-ingest.g.w0.1"])


def test_a_start_that_died_before_fencing_leaves_its_predecessor_to_the_next() -> None:
    ids = TransactionalIds(fakeredis.FakeRedis(), "p:", "g", "w0")
    ids.fenced(ids.next()[0])  # generation 1 ran
    ids.next()  # generation 2 died before fencing 1
    third, stale = ids.next()
    assert third.endswith(".3")
    assert stale == ["rtrl-ingest.g.w0.1", "rtrl-ingest.g.w0.2"]


def test_fencing_is_bounded_and_replicas_are_independent() -> None:
    r = fakeredis.FakeRedis()
    ids = TransactionalIds(r, "p:", "g", "w0")
    for _ in range(30):
        ids.next()
    _, stale = ids.next()
    assert len(stale) == TransactionalIds.KEEP
    assert TransactionalIds(r, "p:", "g", "w1").next() == ("rtrl-ingest.g.w1.1", [])
