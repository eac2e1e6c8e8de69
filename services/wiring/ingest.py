"""``rtrl serve ingest``: validate, authenticate and dedup raw events, exactly once.

One worker = one member of the ingest group on the raw topic, run by the exactly-once loop
(services/runtime/exactly_once.py, which documents the transaction and recovery
protocol). Per polled batch, :class:`IngestTransform`:

1. puts every record through ``ingest.validate.validate`` (pure);
2. claims the accepted events' ``event_id`` in the dedup store (one Redis round trip); a
   claim made by the same raw position again (a replayed batch) is not a duplicate
   (ingest/dedup.py), so replays after a failure are safe;
3. returns the valid events (for the events topic, keyed by ``request_id``) and the
   rejected records (for the DLQ, reason attached), which the loop commits in one
   transaction with the batch's offsets.

SIGTERM finishes the current batch, commits it and exits 0; exit 2 means the broker or
Redis never answered at start, exit 3 that another worker took over the transactional id.
"""

from __future__ import annotations

import base64
import json
import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from kafka.structs import TopicPartition

from ingest.adapters.redis_dedup import RedisDedupStore
from ingest.auth import AuthPolicy
from ingest.contracts import prometheus as m
from ingest.contracts.keys import ingest_txn_generation_key
from ingest.contracts.transactions import ingest_base
from ingest.dedup import SOURCE_HEADER, DedupStore, is_duplicate, position_marker
from ingest.validate import Accepted, Limits, Rejected, validate
from services.runtime.exactly_once import Batch, ExactlyOnceLoop, FencedError, Output
from services.runtime.health import Health, HttpEndpoints
from services.runtime.kafka_io import ensure_topics, make_member, wait_for_broker
from services.runtime.process import Stopper
from services.runtime.redis_io import make_redis, wait_for_redis
from services.runtime.transactions import TransactionalIds, TransactionalProducers, unique_transactional_id
from services.settings.model import Settings

log = logging.getLogger("rtrl.ingest")

SERVICE = "ingest"
REASON_HEADER = "rtrl-reason"
DLQ_ORIGINAL_MAX = 512 * 1024
"""Most original bytes a DLQ record carries (less when the record size limit is lower:
:func:`dlq_original_max`)."""
DLQ_HEADERS_MAX = 32
DLQ_HEADER_NAME_MAX = 64
"""A DLQ record lists at most this many header names, each cut to this many characters."""
DLQ_ROOM = 32 * 1024
"""Room a DLQ record needs beside the base64 of the original, at worst: the header names
(32 x 64 characters, 12 bytes each once JSON-escaped), the base64 of a 1 KiB key, the detail,
the source topic and the framing."""


def dlq_original_max(max_message_bytes: int) -> int:
    """Most original bytes a DLQ record can carry so that it fits one record of
    ``max_message_bytes``: a DLQ record that cannot be written would stall its partition."""
    return min(DLQ_ORIGINAL_MAX, (max_message_bytes - DLQ_ROOM) * 3 // 4)
DLQ_KEY_MAX = 1024
"""Keys are not bounded by ``max_bytes``; DLQ records keep at most this much of one."""


def auth_policy(settings: Settings) -> AuthPolicy:
    a = settings.auth
    return AuthPolicy(
        keys={k: v.get_secret_value().encode() for k, v in a.keys.items()},
        allow_unsigned=a.allow_unsigned,
        key_id_header=a.key_id_header,
        signature_header=a.signature_header,
    )


def limits(settings: Settings) -> Limits:
    s = settings.ingest
    return Limits(max_bytes=s.max_bytes, max_future_skew_s=s.max_future_skew_s, max_age_s=s.max_age_s)


def dlq_record(record: Any, rejected: Rejected, received_at: datetime,
               original_max: int = DLQ_ORIGINAL_MAX) -> bytes:
    """The DLQ value for a rejected raw record (format documented in docs/ingest.md).

    Header *names* only are kept: a signature value must never be copied anywhere.
    """
    key = record.key[:DLQ_KEY_MAX] if record.key is not None else None
    value = record.value if record.value is not None else b""
    doc = {
        "reason": rejected.reason,
        "detail": rejected.detail,
        "source": {
            "topic": record.topic,
            "partition": record.partition,
            "offset": record.offset,
            "key": base64.b64encode(key).decode() if key is not None else None,
            "timestamp_ms": record.timestamp,
        },
        "headers": [name[:DLQ_HEADER_NAME_MAX] for name, _ in (record.headers or [])[:DLQ_HEADERS_MAX]],
        "original_b64": base64.b64encode(value[:original_max]).decode(),
        "original_size": len(value),
        "original_truncated": len(value) > original_max,
        "received_at": received_at.isoformat().replace("+00:00", "Z"),
    }
    return json.dumps(doc, separators=(",", ":")).encode()


@dataclass
class IngestCounts:
    """What one batch did; counted in metrics only after its transaction commits."""

    valid: int = 0
    duplicate: int = 0
    rejected: Counter[str] = field(default_factory=Counter)


class IngestTransform:
    """Validate, authenticate and dedup one polled batch of raw records (see the module doc)."""

    def __init__(self, settings: Settings, dedup: DedupStore,
                 clock: Callable[[], datetime] = lambda: datetime.now(UTC)) -> None:
        self.topics = settings.topics
        self.dlq_duplicates = settings.ingest.dlq_duplicates
        self.limits = limits(settings)
        self.original_max = dlq_original_max(settings.kafka.max_message_bytes)
        self.auth = auth_policy(settings)
        self.dedup = dedup
        self.clock = clock

    def transform(self, polled: Mapping[TopicPartition, Sequence[Any]],
                  assigned: Sequence[TopicPartition]) -> Batch[IngestCounts]:
        now = self.clock()
        counts = IngestCounts()
        accepted, rejected = self._validate(polled, now)
        claims = [(a.event.event_id, position_marker(r.topic, r.partition, r.offset)) for r, a in accepted]
        held = self.dedup.claim_many(claims) if claims else []
        outputs: list[Output] = []
        for (rec, acc), (_, marker), prev in zip(accepted, claims, held, strict=True):
            if is_duplicate(prev, marker):
                counts.duplicate += 1
                if self.dlq_duplicates:
                    why = f"its event_id was first seen at {prev}"
                    rejected.append((rec, Rejected("duplicate", why)))
                continue
            ev = acc.event
            outputs.append(Output(self.topics.events, ev.model_dump_json().encode(), ev.request_id.encode(),
                                  ((SOURCE_HEADER, marker.encode()),)))
            counts.valid += 1
        for rec, rej in rejected:
            key = rec.key[:DLQ_KEY_MAX] if rec.key is not None else None
            outputs.append(Output(self.topics.dlq, dlq_record(rec, rej, now, self.original_max), key,
                                  ((REASON_HEADER, rej.reason.encode()),)))
            counts.rejected[rej.reason] += 1
        return Batch(outputs, counts)

    def _validate(self, polled: Mapping[TopicPartition, Sequence[Any]], now: datetime
                  ) -> tuple[list[tuple[Any, Accepted]], list[tuple[Any, Rejected]]]:
        accepted: list[tuple[Any, Accepted]] = []
        rejected: list[tuple[Any, Rejected]] = []
        for records in polled.values():
            for rec in records:
                out = validate(rec.value, rec.headers or [], rec.key, now, self.limits, self.auth)
                if isinstance(out, Accepted):
                    accepted.append((rec, out))
                else:
                    rejected.append((rec, out))
        return accepted, rejected

    def committed(self, batch: Batch[IngestCounts], delivered: Sequence[Any]) -> None:
        _count(batch.result)

    def recover(self, partitions: Sequence[TopicPartition]) -> None:
        """Nothing to do: the dedup markers make a replayed batch safe by themselves."""


def _count(result: IngestCounts) -> None:
    if result.valid:
        m.INGEST_EVENTS.labels("valid").inc(result.valid)
    if result.duplicate:
        m.INGEST_EVENTS.labels("duplicate").inc(result.duplicate)
    n_rejected = sum(n for reason, n in result.rejected.items() if reason != "duplicate")
    if n_rejected:
        m.INGEST_EVENTS.labels("rejected").inc(n_rejected)
    for reason, n in result.rejected.items():
        m.INGEST_REJECTED.labels(reason).inc(n)


def transactional_ids(client: Any, key_prefix: str, group_id: str, instance_id: str) -> TransactionalIds:
    """``rtrl-ingest.<group>.<instance>.<generation>``, the generation counted in Redis."""
    return TransactionalIds(client, ingest_txn_generation_key(key_prefix, group_id, instance_id),
                            ingest_base(group_id, instance_id))


# ---------------------------------------------------------------------- entry point
def run_worker(
    settings: Settings,
    stopper: Stopper,
    group_id: str | None = None,
    max_batch: int | None = None,
    metrics_port: int | None = None,
    on_ready: Callable[[HttpEndpoints], None] | None = None,
) -> int:
    """Run one ingest worker until ``stopper`` is set; returns the exit code."""
    s = settings.ingest
    group = group_id or s.group_id
    batch = max_batch or s.max_batch
    health = Health()
    http = HttpEndpoints(health, settings.http.host,
                         settings.http.port if metrics_port is None else metrics_port,
                         m.registry_for(SERVICE)).start()
    if on_ready is not None:
        on_ready(http)
    loop: ExactlyOnceLoop[IngestCounts] | None = None
    try:
        try:
            wait_for_broker(settings.kafka, timeout_s=60)
            wait_for_redis(settings.redis.url.get_secret_value(), timeout_s=10)
        except TimeoutError as exc:
            log.error("cannot start: %s", exc)
            return 2
        ensure_topics(settings, [settings.topics.raw, settings.topics.events, settings.topics.dlq])
        redis_client = make_redis(settings.redis)
        ids = transactional_ids(redis_client, settings.redis.key_prefix, group, s.instance_id) \
            if s.instance_id else None
        producers = TransactionalProducers(
            settings.kafka, s.transaction_timeout_ms, ids, lambda: unique_transactional_id(SERVICE, group),
            batch_size=256 * 1024,  # a whole polled batch per partition in one produce request
        )
        consumer = make_member(settings.kafka, group, max_poll_records=batch,
                                 max_poll_interval_ms=s.max_poll_interval_ms,
                                 group_instance_id=s.instance_id)
        dedup = RedisDedupStore(redis_client, settings.redis.key_prefix, s.dedup_ttl_s)
        loop = ExactlyOnceLoop(SERVICE, consumer, producers.open, IngestTransform(settings, dedup), health,
                               poll_timeout_ms=s.poll_timeout_ms, max_records=batch)
        loop.start([settings.topics.raw])
        log.info("ingest worker up: group %s, transactional id %s, %s -> %s / %s",
                 group, producers.txn_id, settings.topics.raw, settings.topics.events, settings.topics.dlq)
        loop.run(stopper)
        log.info("stopped cleanly")
        return 0
    except FencedError as exc:
        log.error("%s; stopping", exc)
        return 3
    finally:
        if loop is not None:
            loop.close()
        http.stop()
