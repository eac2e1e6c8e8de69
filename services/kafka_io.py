"""Kafka adapters: producer, consumer and admin factories built from settings.

Only this module and the service entry points import kafka-python; domain code never does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer
from kafka.admin import NewTopic
from kafka.errors import KafkaError, TopicAlreadyExistsError

from services.settings import KafkaSettings, Settings, TopicSettings

log = logging.getLogger(__name__)


def make_producer(kafka: KafkaSettings, **overrides: Any) -> KafkaProducer:
    """A producer with safe defaults: acks=all, idempotent, keys and values as bytes."""
    kw: dict[str, Any] = {
        **kafka.client_kwargs(),
        "acks": "all",
        "enable_idempotence": True,
        "linger_ms": 5,
        "retries": 2**31 - 1,
    }
    kw.update(overrides)
    return KafkaProducer(**kw)


def make_consumer(
    kafka: KafkaSettings, group_id: str | None, topics: Iterable[str] = (), **overrides: Any
) -> KafkaConsumer:
    """A consumer that never auto-commits and reads only committed transactional data."""
    kw: dict[str, Any] = {
        **kafka.client_kwargs(),
        "group_id": group_id,
        "enable_auto_commit": False,
        "auto_offset_reset": "earliest",
        "isolation_level": "read_committed",
        "max_poll_records": 500,
        "session_timeout_ms": 6000,
        "heartbeat_interval_ms": 1500,
    }
    kw.update(overrides)
    return KafkaConsumer(*topics, **kw)


def make_admin(kafka: KafkaSettings) -> KafkaAdminClient:
    return KafkaAdminClient(**kafka.client_kwargs())


def wait_for_broker(kafka: KafkaSettings, timeout_s: float = 30.0) -> None:
    """Block until the broker answers a metadata request; raise TimeoutError otherwise."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            admin = make_admin(kafka)
            try:
                admin.list_topics()
                return
            finally:
                admin.close()
        except (KafkaError, OSError, ValueError) as exc:
            last = exc
            time.sleep(0.2)
    raise TimeoutError(f"Kafka at {kafka.bootstrap_servers} did not answer in {timeout_s}s: {last}")


def topic_names(topics: TopicSettings) -> list[str]:
    return [topics.raw, topics.events, topics.rewards, topics.dlq]


def ensure_topics(settings: Settings, names: Iterable[str] | None = None) -> list[str]:
    """Create missing topics with the configured partitions; return the ones created."""
    topics = settings.topics
    wanted = list(names) if names is not None else topic_names(topics)
    if not topics.create:
        return []
    admin = make_admin(settings.kafka)
    try:
        existing = set(admin.list_topics())
        missing = [n for n in wanted if n not in existing]
        if missing:
            try:
                admin.create_topics(
                    [NewTopic(n, topics.partitions, topics.replication_factor) for n in missing]
                )
            except TopicAlreadyExistsError:
                pass
            log.info("created topics %s", missing)
        return missing
    finally:
        admin.close()
