"""In-memory fakes of the ingest domain's ports, beside their real adapters (unit tier only)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence


class MemoryDedupStore:
    """In-memory DedupStore with expiry, for unit tests."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._seen: dict[str, tuple[str, float]] = {}

    def claim_many(self, claims: Sequence[tuple[str, str]]) -> list[str | None]:
        now = self._clock()
        out: list[str | None] = []
        for event_id, marker in claims:
            held = self._seen.get(event_id)
            if held is not None and held[1] > now:
                out.append(held[0])
            else:
                self._seen[event_id] = (marker, now + self.ttl_s)
                out.append(None)
        return out

    def forget(self, event_id: str) -> None:
        self._seen.pop(event_id, None)
