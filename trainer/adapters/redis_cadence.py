"""The trainer's schedule as ``rtrl status`` shows it: written by ``rtrl serve trainer`` after
each cadence check, read by the CLI. One JSON document under
``ingest.contracts.keys.cadence_key``, expiring so a stopped trainer shows as absent."""

from __future__ import annotations

from typing import Any

from ingest.adapters.redis_json import read_json, write_json
from ingest.contracts.keys import cadence_key


def write_cadence(client: Any, prefix: str, body: dict[str, Any], ttl_s: int) -> None:
    """Store the last cadence decision for ``ttl_s`` seconds."""
    write_json(client, cadence_key(prefix), body, ttl_s)


def read_cadence(client: Any, prefix: str) -> dict[str, Any] | None:
    """The trainer's last cadence decision, or None (no trainer service, or not for a while:
    the key expires)."""
    return read_json(client, cadence_key(prefix))
