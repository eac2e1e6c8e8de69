"""A small client that sends events to the raw topic, signed the way ingest expects.

The gateway, the simulator, tests and benchmarks all produce through this::

    producer = EventProducer(settings, key_id="gateway", secret=b"...")
    producer.send(event)          # an ingest.events model
    producer.flush()
    producer.close()

Each record's value is ``event.model_dump_json()``, its key the ``request_id`` (so every
event of a request lands on one partition) and its headers carry the key id and the
HMAC-SHA256 signature of the value (see ingest/auth.py). ``key_id=None`` sends unsigned
records, which ingest accepts only with ``RTRL_AUTH__ALLOW_UNSIGNED=true`` (development).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from pydantic import BaseModel, SecretStr

from ingest.auth import sign
from services.runtime.kafka_io import make_producer
from services.settings.model import Settings


class _Producer(Protocol):
    """The part of kafka-python's KafkaProducer this client uses."""

    def send(
        self, topic: str, value: bytes | None = ..., key: bytes | None = ...,
        headers: list[tuple[str, bytes]] | None = ...,
    ) -> Any: ...

    def flush(self, timeout: float | None = ...) -> None: ...

    def close(self, timeout: float | None = ...) -> None: ...


class EventTooLargeError(ValueError):
    """An event larger than ``RTRL_INGEST__MAX_BYTES``: ingest would dead-letter it as
    ``oversized``, so it is refused here, before anything is sent."""


class EventProducer:
    """Signs and sends events (or raw bytes) to ``settings.topics.raw``."""

    def __init__(
        self,
        settings: Settings,
        key_id: str | None,
        secret: bytes | str | SecretStr | None,
        producer: _Producer | None = None,
        topic: str | None = None,
    ) -> None:
        if key_id is not None and secret is None:
            raise ValueError(f"key id {key_id!r} needs a secret (or pass key_id=None to send unsigned)")
        if isinstance(secret, SecretStr):
            secret = secret.get_secret_value()
        self._secret = secret.encode() if isinstance(secret, str) else secret
        self._key_id = key_id
        self._auth = settings.auth
        self.topic = topic or settings.topics.raw
        self.max_bytes = settings.ingest.max_bytes
        if producer is None:
            producer = make_producer(settings.kafka)
        self._producer = producer

    def headers_for(self, value: bytes) -> list[tuple[str, bytes]]:
        """The authentication headers for ``value`` (empty when unsigned)."""
        if self._key_id is None or self._secret is None:
            return []
        return [
            (self._auth.key_id_header, self._key_id.encode()),
            (self._auth.signature_header, sign(value, self._secret).encode()),
        ]

    def send(self, event: BaseModel) -> Any:
        """Serialise, sign and send one event keyed by its request_id; returns the future.
        Raises :class:`EventTooLargeError` for an event larger than ingest accepts."""
        value = event.model_dump_json().encode()
        if len(value) > self.max_bytes:
            raise EventTooLargeError(
                f"event of {len(value)} bytes exceeds RTRL_INGEST__MAX_BYTES ({self.max_bytes}): "
                "ingest would dead-letter it as oversized; not sent")
        request_id = getattr(event, "request_id", None)
        key = request_id.encode() if isinstance(request_id, str) else None
        return self._producer.send(self.topic, value=value, key=key, headers=self.headers_for(value))

    def send_raw(
        self,
        value: bytes | None,
        headers: Sequence[tuple[str, bytes]] | None = None,
        key: bytes | None = None,
        sign_value: bool = False,
    ) -> Any:
        """Send arbitrary bytes with the given headers (tests, fuzzing, replays).

        ``sign_value=True`` appends this producer's signature headers for ``value``.
        """
        hdrs = list(headers or [])
        if sign_value and value is not None:
            hdrs += self.headers_for(value)
        return self._producer.send(self.topic, value=value, key=key, headers=hdrs)

    def flush(self, timeout: float | None = None) -> None:
        self._producer.flush(timeout)

    def close(self, timeout: float | None = None) -> None:
        self._producer.close(timeout)

    def __enter__(self) -> EventProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.flush()
        self.close()
