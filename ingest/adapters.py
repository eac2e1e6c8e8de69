"""Redis adapter for ingest's dedup store (ingest/dedup.py)."""

from __future__ import annotations

from collections.abc import Sequence

import redis


class RedisDedupStore:
    """DedupStore on Redis: ``SET <prefix>ingest:dedup:<event_id> <marker> NX EX <ttl>``.

    One MULTI/EXEC round trip per batch: a ``SET NX`` and a ``GET`` per id, so each claim
    learns the marker that holds the id after it (its own or an earlier one).
    """

    def __init__(self, client: redis.Redis, key_prefix: str, ttl_s: int) -> None:
        if ttl_s <= 0:
            raise ValueError(f"dedup TTL must be positive, got {ttl_s}")
        self._r = client
        self._prefix = f"{key_prefix}ingest:dedup:"
        self.ttl_s = ttl_s

    def key(self, event_id: str) -> str:
        return self._prefix + event_id

    def claim_many(self, claims: Sequence[tuple[str, str]]) -> list[str | None]:
        if not claims:
            return []
        pipe = self._r.pipeline(transaction=True)
        for event_id, marker in claims:
            k = self.key(event_id)
            pipe.set(k, marker, nx=True, ex=self.ttl_s)
            pipe.get(k)
        replies = pipe.execute()
        out: list[str | None] = []
        for i in range(len(claims)):
            stored, held = replies[2 * i], replies[2 * i + 1]
            if stored:
                out.append(None)
            else:
                out.append(held.decode() if isinstance(held, bytes) else held)
        return out

    def forget(self, event_id: str) -> None:
        self._r.delete(self.key(event_id))
