"""Consumer-group lag read from a real broker (deployer/adapters/group_lag.py): the backlog
and its age are right for a group that committed part of a topic, for one that never
committed, and after the group's only consumer died without leaving the group."""

from __future__ import annotations

import time

import pytest
from kafka import TopicPartition
from kafka.structs import OffsetAndMetadata

from deployer.adapters.group_lag import BrokerOffsets
from services.runtime.kafka_io import ensure_topics, make_admin, make_consumer, make_producer
from services.settings.model import Settings

pytestmark = pytest.mark.integration


def _reader(settings: Settings) -> BrokerOffsets:
    return BrokerOffsets(make_admin(settings.kafka),
                         make_consumer(settings.kafka, None, allow_auto_create_topics=False))


def test_lag_in_messages_and_seconds_from_the_brokers_offsets(settings: Settings) -> None:
    topic = settings.topics.raw
    ensure_topics(settings, [topic])
    now_ms = int(time.time() * 1000)
    producer = make_producer(settings.kafka)
    try:
        for i in range(10):  # partition 0: 10 records from 300 s ago; partition 1: 5 from 120 s ago
            producer.send(topic, value=b"a", partition=0, timestamp_ms=now_ms - 300_000 + i * 1000)
        for i in range(5):
            producer.send(topic, value=b"b", partition=1, timestamp_ms=now_ms - 120_000 + i * 1000)
        producer.flush(30)
    finally:
        producer.close()

    group = f"{topic}-group"
    member = make_consumer(settings.kafka, group)
    member.assign([TopicPartition(topic, 0), TopicPartition(topic, 1)])
    member.commit({TopicPartition(topic, 0): OffsetAndMetadata(4, "", -1),
                   TopicPartition(topic, 1): OffsetAndMetadata(5, "", -1)})
    # the member is gone without leaving (as after kill -9): the broker still holds its offsets
    reader = _reader(settings)
    try:
        lag = reader.group_lag(group, topic, now=now_ms / 1000.0)
        assert lag.messages == 6  # p0: 6 behind, p1: caught up
        assert lag.seconds == pytest.approx(300 - 4, abs=0.01)  # the record at offset 4 of p0
        fresh = reader.group_lag(f"{topic}-never", topic, now=now_ms / 1000.0)
        assert fresh.messages == 15
        assert fresh.seconds == pytest.approx(300, abs=0.01)
        done = reader.group_lag(group, settings.topics.events, now=now_ms / 1000.0)
        assert (done.messages, done.seconds) == (0, 0.0)  # a topic that does not exist
    finally:
        reader.close()
        member.close(autocommit=False)
