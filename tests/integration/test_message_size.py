"""One record size limit from client to broker (a real broker): rtrl's producers refuse a
record over ``RTRL_KAFKA__MAX_MESSAGE_BYTES`` before sending it, the topics rtrl creates
refuse it too (for clients that are not rtrl's), and a record just under it goes through."""

from __future__ import annotations

import pytest
from kafka.errors import MessageSizeTooLargeError

from services.runtime.kafka_io import ensure_topics, make_producer
from services.settings.model import Settings

pytestmark = pytest.mark.integration


def test_the_record_size_limit_holds_from_client_to_broker(settings: Settings) -> None:
    m = settings.kafka.max_message_bytes
    ensure_topics(settings, [settings.topics.raw])
    ours = make_producer(settings.kafka)
    try:
        with pytest.raises(MessageSizeTooLargeError):
            ours.send(settings.topics.raw, value=b"x" * (m + 1))  # refused before sending
        ours.send(settings.topics.raw, value=b"y" * (m - 2048)).get(timeout=30)  # fits
    finally:
        ours.close()
    other = make_producer(settings.kafka, max_request_size=8 * 1024 * 1024)  # a client with a higher limit
    try:
        with pytest.raises(MessageSizeTooLargeError):
            other.send(settings.topics.raw, value=b"z" * (m + 4096)).get(timeout=30)  # the broker refuses
    finally:
        other.close()
