"""Reading back what a transactional worker committed to one of its output partitions.

A worker that marks its outputs done in Redis only after their transaction committed may die
between the two; on every assignment it reads its outputs back from a checkpoint to the
partition's end. The end must be *stable*: every transaction that wrote below the high watermark
seen when recovery starts must be over (the last stable offset has reached that high watermark),
or records of a commit still in flight would be missed. Transactions opened later by other
writers of the partition (several workers write each partition) do not hold recovery up.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from kafka import KafkaConsumer, TopicPartition
from kafka.consumer.fetcher import ConsumerRecord
from kafka.errors import KafkaTimeoutError


class CommittedTail:
    """A read_committed and a read_uncommitted reader, both unsubscribed (``assign`` only)."""

    def __init__(self, committed: KafkaConsumer, uncommitted: KafkaConsumer, beat: Callable[[], None],
                 transaction_timeout_ms: int) -> None:
        self.committed = committed
        self.uncommitted = uncommitted
        self.beat = beat
        """Called while waiting (the process's liveness heartbeat)."""
        self.wait_s = transaction_timeout_ms / 1000 + 10

    def stable_end(self, tp: TopicPartition) -> int:
        """The last stable offset once it has reached the high watermark of now (module doc);
        raises after the transaction timeout (plus 10 s) if a transaction stays open."""
        deadline = time.monotonic() + self.wait_s
        hw = self.uncommitted.end_offsets([tp])[tp]
        while True:
            lso = self.committed.end_offsets([tp])[tp]
            if lso >= hw:
                return int(lso)
            if time.monotonic() > deadline:
                # a Kafka error: the exactly-once loop retries recovery with backoff
                raise KafkaTimeoutError(f"{tp.topic} partition {tp.partition} keeps an open transaction "
                                        f"(LSO {lso} < HW {hw})")
            self.beat()
            time.sleep(0.2)

    def read(self, tp: TopicPartition, start: int, end: int) -> Iterator[ConsumerRecord]:
        """The committed records of ``tp`` from ``start`` up to ``end``."""
        rc = self.committed
        rc.assign([tp])
        rc.seek(tp, start)
        while rc.position(tp) < end:
            for recs in rc.poll(timeout_ms=500, max_records=5000).values():
                yield from (r for r in recs if r.offset < end)
            self.beat()

    def close(self) -> None:
        for reader in (self.committed, self.uncommitted):
            reader.close(autocommit=False)
