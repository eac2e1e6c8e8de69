"""A JSON object stored under one Redis key: the shape of the small status documents that
one process writes and ``rtrl status`` reads (the trainer's cadence, the holdout report)."""

from __future__ import annotations

import json
from typing import Any


def read_json(client: Any, key: str) -> dict[str, Any] | None:
    """The JSON object stored at ``key``; None when absent or not a JSON object."""
    raw = client.get(key)
    if raw is None:
        return None
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def write_json(client: Any, key: str, body: dict[str, Any], ttl_s: int | None = None) -> None:
    """Store ``body`` at ``key`` (expiring after ``ttl_s`` seconds when given)."""
    client.set(key, json.dumps(body), ex=ttl_s)
