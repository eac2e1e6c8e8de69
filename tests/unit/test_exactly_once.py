"""The exactly-once loop (services/runtime/exactly_once.py) against in-memory doubles of the
consumer and the transactional producer: what one transaction carries, and what happens on
each kind of failure. The SIGKILL tests in tests/integration run it on a real broker."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import redis
from kafka.errors import KafkaConnectionError, ProducerFencedError
from kafka.structs import TopicPartition
from kafka_fakes import FakeConsumer, FakeProducer, Rec

from services.runtime.exactly_once import Batch, ExactlyOnceLoop, FencedError, Output, next_offsets
from services.runtime.health import Health
from services.runtime.process import Stopper

TP0, TP1 = TopicPartition("in", 0), TopicPartition("in", 1)


class Echo:
    """Echoes each record's value to ``out``; records the calls the loop makes."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.fail: list[Exception] = []

    def transform(self, polled: Mapping[TopicPartition, Sequence[Any]],
                  assigned: Sequence[TopicPartition]) -> Batch[int]:
        if self.fail:
            raise self.fail.pop(0)
        outs = [Output("out", r.value or b"", r.key) for recs in polled.values() for r in recs]
        self.owned = list(assigned)
        self.calls.append(("transform", len(outs)))
        return Batch(outs, len(outs))

    def committed(self, batch: Batch[int], delivered: Sequence[Any]) -> None:
        self.calls.append(("committed", [(d.topic, d.offset) for d in delivered]))

    def recover(self, partitions: Sequence[TopicPartition]) -> None:
        self.calls.append(("recover", sorted(p.partition for p in partitions)))


def make_loop(fault: Any = None) -> tuple[ExactlyOnceLoop[int], FakeConsumer, list[FakeProducer], Echo]:
    consumer = FakeConsumer([TP0, TP1])
    producers: list[FakeProducer] = []

    def open_producer() -> FakeProducer:
        producers.append(FakeProducer())
        return producers[-1]

    echo = Echo()
    loop = ExactlyOnceLoop("test", consumer, open_producer, echo, Health(),  # type: ignore[arg-type]
                           poll_timeout_ms=10, max_records=100, fault=fault)
    loop.start(["in"])
    return loop, consumer, producers, echo


def run_until_idle(loop: ExactlyOnceLoop[int], consumer: FakeConsumer, max_iterations: int = 20) -> None:
    """``run`` with a stopper that stops once no batch is queued and the loop is healthy."""
    stopper = Stopper()
    real_poll = consumer.poll

    def poll(**kw: Any) -> Any:
        got = real_poll(**kw)
        if not consumer.batches and consumer.poll_error is None:
            stopper.stop()
        return got

    consumer.poll = poll  # type: ignore[method-assign]
    stopper.wait = lambda timeout=None: stopper.stopping  # type: ignore[method-assign]  # no real backoff
    loop.run(stopper)


def test_outputs_and_offsets_commit_in_one_transaction() -> None:
    loop, consumer, producers, echo = make_loop()
    assert echo.calls == [("recover", [0, 1])], "assignment is recovered before any transform"
    consumer.batches.append({TP0: [Rec(7, b"a", b"k"), Rec(8, b"b")], TP1: [Rec(3, b"c")]})
    batch = loop.step()
    assert batch is not None and batch.result == 3
    (prod,) = producers
    assert [(t, v) for t, v, _, _ in prod.committed] == [("out", b"a"), ("out", b"b"), ("out", b"c")]
    assert prod.offsets == [{TP0: (9, "", -1), TP1: (4, "", -1)}]
    assert echo.calls[-1] == ("committed", [("out", 0), ("out", 1), ("out", 2)])


def test_an_empty_poll_commits_nothing_but_finishes_the_batch() -> None:
    loop, _, producers, echo = make_loop()
    assert loop.step() is None
    assert producers[0].committed == [] and producers[0].offsets == []
    assert echo.calls[-1] == ("committed", [])


def test_a_failed_commit_aborts_replaces_the_producer_rewinds_and_recovers() -> None:
    loop, consumer, producers, echo = make_loop()
    consumer.committed_offsets = {TP0: 5}
    batch = {TP0: [Rec(5, b"x"), Rec(6, b"y")]}
    consumer.batches += [batch, batch]  # the broker hands the batch back after the rewind
    producers[0].fail_commit = 1
    run_until_idle(loop, consumer)
    first, second = producers
    assert first.aborts == 1 and first.committed == [] and first.closed
    assert [v for _, v, _, _ in second.committed] == [b"x", b"y"]
    assert second.offsets == [{TP0: (7, "", -1)}]
    assert (TP0, 5) in consumer.seeks and (TP1, 0) in consumer.seeks  # committed, or the beginning
    assert ("recover", [0, 1]) in echo.calls[1:], "every owned partition is recovered after a failure"
    assert loop.failing is None


def test_a_redis_failure_before_the_transaction_keeps_the_producer() -> None:
    loop, consumer, producers, echo = make_loop()
    echo.fail.append(redis.ConnectionError("redis restarting"))
    consumer.batches += [{TP0: [Rec(1, b"a")]}, {TP0: [Rec(1, b"a")]}]
    run_until_idle(loop, consumer)
    assert len(producers) == 1, "no transaction was open and Kafka answered: same producer"
    assert [v for _, v, _, _ in producers[0].committed] == [b"a"]


def test_a_poll_failure_is_retried_with_a_new_producer() -> None:
    loop, consumer, producers, _ = make_loop()
    consumer.poll_error = KafkaConnectionError("broker restarting")
    consumer.batches.append({TP1: [Rec(0, b"z")]})
    run_until_idle(loop, consumer)
    assert len(producers) == 2 and [v for _, v, _, _ in producers[1].committed] == [b"z"]


def test_fenced_stops_the_loop() -> None:
    loop, consumer, producers, _ = make_loop()

    def fenced() -> None:
        raise ProducerFencedError("another producer has our id")

    producers[0].commit_transaction = fenced  # type: ignore[method-assign]
    consumer.batches.append({TP0: [Rec(0, b"a")]})
    with pytest.raises(FencedError):
        loop.run(Stopper())


def test_fault_points_come_after_the_sends_before_and_after_the_commit() -> None:
    seen: list[tuple[str, int]] = []

    def fault(point: str) -> None:
        seen.append((point, len(producers[-1].committed)))

    loop, consumer, producers, _ = make_loop(fault=fault)
    consumer.batches.append({TP0: [Rec(0, b"a")]})
    loop.step()
    loop.step()  # an empty batch reaches no fault point
    assert seen == [("mid_txn", 0), ("before_commit", 0), ("after_commit", 1)]


def test_next_offsets_is_one_past_each_partitions_last_record() -> None:
    assert next_offsets({TP0: [Rec(4, b""), Rec(9, b"")], TP1: []}) == {TP0: 10}


def test_revoked_partitions_are_not_the_transforms_until_assigned_again() -> None:
    """kafka-python keeps revoked partitions in ``assignment()`` until the rejoin completes, and
    a non-blocking poll returns meanwhile: a transform that closed timers on them would commit
    rewards for partitions another member owns already (the embedded broker accepts the stale
    generation's offsets)."""
    loop, consumer, producers, echo = make_loop()
    consumer.listener.on_partitions_revoked([TP0, TP1])
    assert consumer.assignment() == {TP0, TP1}, "the double keeps them, as kafka-python does"
    consumer.batches.append({TP0: [Rec(4, b"late")]})  # fetched before the revocation
    assert loop.step() is None
    assert echo.owned == [] and producers[0].committed == [] and producers[0].offsets == []
    consumer.listener.on_partitions_assigned([TP1])
    consumer.batches.append({TP1: [Rec(0, b"x")]})
    assert loop.step() is not None
    assert echo.owned == [TP1] and [v for _, v, _, _ in producers[0].committed] == [b"x"]


def test_a_rebalance_during_the_rewind_does_not_stop_the_worker() -> None:
    """After a failure the loop rewinds each owned partition to its committed offset. Fetching
    that offset is a blocking call during which a rejoin in progress can complete and take a
    partition away; kafka-python then refuses to seek it (ValueError, not a Kafka error), which
    stopped the worker. Its next owner starts from the committed offset anyway."""
    loop, consumer, producers, echo = make_loop()
    consumer.committed_offsets = {TP0: 3, TP1: 5}
    real_committed = consumer.committed

    def committed(tp: TopicPartition, timeout_ms: int | None = None) -> int | None:
        if tp == TP0:  # the rejoin completes while the offset is fetched: TP0 went elsewhere
            consumer.partitions = [TP1]
            consumer.listener.on_partitions_revoked([TP0, TP1])
            consumer.listener.on_partitions_assigned([TP1])
        return real_committed(tp)

    consumer.committed = committed  # type: ignore[method-assign]
    consumer.poll_error = KafkaConnectionError("broker restarting")
    consumer.batches.append({TP1: [Rec(5, b"z")]})
    run_until_idle(loop, consumer)
    assert loop.failing is None and (TP1, 5) in consumer.seeks and (TP0, 3) not in consumer.seeks
    assert [v for _, v, _, _ in producers[-1].committed] == [b"z"]
    assert echo.owned == [TP1]


def test_a_broker_that_does_not_answer_the_lag_query_counts_as_a_kafka_failure() -> None:
    # a non-blocking poll of a dead broker returns nothing and raises nothing: the lag query
    # is where the loop notices, and on-call must see it (RtrlDependencyOutage)
    from ingest.contracts import prometheus as m

    loop, consumer, _, _ = make_loop()
    loop.step()

    def down(*_a: Any, **_k: Any) -> Any:
        raise TimeoutError("broker down")

    consumer.end_offsets = down  # type: ignore[method-assign]
    retries = m.DEPENDENCY_RETRIES.labels("test", "kafka")
    before = retries._value.get()
    loop._last_lag = 0.0
    loop.step()
    assert retries._value.get() == before + 1
