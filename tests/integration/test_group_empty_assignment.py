"""A group member that the broker hands an empty partition assignment keeps running.

Kafka sends empty assignment bytes to a member its leader left out of the SyncGroup, and the
embedded broker sent them to a worker while others joined and left (a crash-consistency run
lost a worker to it: kafka-python 3.0.12 raises ``struct.error`` out of ``poll``). Here the
leader's assignor leaves every other member out, on the real broker, and the left-out member
polls through it (ingest/adapters/idle_poll.py ``rejoin_after_bad_assignment``)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest
from kafka.coordinator.assignors.abstract import ConsumerProtocolAssignment
from kafka.coordinator.assignors.range import RangePartitionAssignor

from ingest.adapters.idle_poll import IdlePoller
from services.runtime.kafka_io import ensure_topics, make_consumer, make_producer
from services.settings.model import Settings

pytestmark = pytest.mark.integration


class LeaderTakesAll(RangePartitionAssignor):
    """The ``range`` protocol, but the leader assigns every partition to the first member and
    leaves the others out of the assignment it sends."""

    @classmethod
    def assign(cls, cluster: Any, members: Any) -> dict[str, Any]:
        first = min(m.member_id for m in members)
        topics = sorted({t for m in members for t in m.metadata.topics})
        parts = [(t, sorted(cluster.partitions_for_topic(t) or ())) for t in topics]
        return {first: ConsumerProtocolAssignment(cls.version, parts, b"")}


def test_a_member_left_out_of_the_assignment_rejoins_instead_of_crashing(
        settings: Settings, caplog: pytest.LogCaptureFixture) -> None:
    topic = settings.topics.raw
    ensure_topics(settings, [topic])
    group = f"{topic}-left-out"
    members = [make_consumer(settings.kafka, group, partition_assignment_strategy=[LeaderTakesAll])
               for _ in range(2)]
    producer = make_producer(settings.kafka)
    got = [0, 0]
    errors: list[BaseException] = []
    stop = threading.Event()

    def member(i: int) -> None:  # each member polls on its own thread, as each worker would
        poller = IdlePoller(members[i], idle_ms=50, wait=stop.wait)
        try:
            while not stop.is_set():  # a struct.error out of poll ends the member: the test fails
                got[i] += sum(len(r) for r in poller.poll(max_records=100).values())
        except BaseException as exc:
            errors.append(exc)

    try:
        for m in members:
            m.subscribe([topic])
        for i in range(20):
            producer.send(topic, value=b"%d" % i, partition=i % 4)
        producer.flush(30)
        with caplog.at_level(logging.WARNING, logger="ingest.adapters.idle_poll"):
            threads = [threading.Thread(target=member, args=(i,), daemon=True) for i in range(2)]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not errors and not (
                    sum(got) >= 20 and _rejoins(caplog) >= 2):
                time.sleep(0.1)
            stop.set()
            for t in threads:
                t.join(10)
        assert not errors, f"a member stopped: {errors[0]!r}"
        assert _rejoins(caplog) >= 2, "no member was left out: the case under test never happened"
        assert sum(got) >= 20  # the member holding the partitions read them all meanwhile
    finally:
        stop.set()
        producer.close()
        for m in members:
            m.close(autocommit=False, timeout_ms=2000)  # a LeaveGroup during a join goes unanswered


def _rejoins(caplog: pytest.LogCaptureFixture) -> int:
    return sum("could not be decoded" in r.getMessage() for r in caplog.records)
