"""Duplicate detection by ``event_id``, safe under crash and replay.

The store remembers, for each ``event_id``, a *marker*: the source position
``topic:partition:offset`` of the record that first claimed it. A later record with the
same ``event_id`` is a duplicate only if its own position differs from the marker.

Why the marker: ingest claims ids before its Kafka transaction commits. If the worker dies
in between, the transaction is aborted and the same records are read again from the last
committed offset. Their ids are already claimed — but by themselves, at the same
positions, so they are forwarded, not dropped. A plain "seen before?" set would lose them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

SOURCE_HEADER = "rtrl-source"
"""Header ingest puts on every record it forwards or dead-letters: the raw record's marker."""


def position_marker(topic: str, partition: int, offset: int) -> str:
    """The marker of a source record: ``topic:partition:offset``."""
    return f"{topic}:{partition}:{offset}"


def is_duplicate(existing: str | None, marker: str) -> bool:
    """True when an id was first claimed by a different record than the one at ``marker``."""
    return existing is not None and existing != marker


class DedupStore(Protocol):
    """Remembers which source record first claimed each event id (for a TTL)."""

    def claim_many(self, claims: Sequence[tuple[str, str]]) -> list[str | None]:
        """Claim each ``(event_id, marker)`` in order, atomically per id.

        Returns, per claim, None when this call stored the marker (first sighting), else
        the marker already stored — possibly by an earlier claim in the same call. Raises
        on a store failure; nothing returned means nothing can be assumed claimed.
        """
        ...

    def forget(self, event_id: str) -> None:
        """Drop an id (operations: re-admit an event that was wrongly dropped)."""
        ...


def duplicates(store: DedupStore, claims: Sequence[tuple[str, str]]) -> list[bool]:
    """Claim a batch and say, per claim, whether it is a duplicate to drop."""
    existing = store.claim_many(claims)
    return [is_duplicate(prev, marker) for prev, (_, marker) in zip(existing, claims, strict=True)]
