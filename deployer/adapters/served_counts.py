"""Served and failed requests per (model version, arm), shared through Redis.

A failed request never produces a reward record, so the judge's error-rate guardrail needs
the gateway's own counts. The gateway counts in memory (nothing on the request path) and a
background thread adds the counts to Redis every ``flush_s``; the deployer sums them since
its canary started.

Keys: ``{prefix}gateway:served:{version}:{arm}`` (``ingest.contracts.keys.served_key``), a hash
with fields ``r:{bucket}`` (requests), ``e:{bucket}`` (errors) and ``u:{bucket}:{user_key}``
(errors of one user), where a bucket is ``ts // BUCKET_S``. Time buckets let the deployer count
"since the canary started" without a baseline snapshot; keys expire after ``TTL_S`` without
traffic. The canary arm is counted by assignment: a canary request that failed and was then
served by stable counts as one canary request and one canary error.

Errors are also kept per user so that the judge can cluster the error rate by user (one user's
burst of retries is one user's evidence, not many independent failures). Successes need no
per-user count: each has a reward record with its user. At most ``MAX_USER_FIELDS`` users per
flush are written per key (a broken canary failing everyone is caught long before); the rest
stay in ``e:`` and the judge counts them as one user each.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from ingest.contracts.keys import served_key

log = logging.getLogger(__name__)

BUCKET_S = 10
TTL_S = 8 * 86_400
MAX_USER_FIELDS = 1_000
"""Per key and flush: per-user error fields written at most (bounds a hash under a failure storm)."""


def sum_since(fields: Mapping[Any, Any], since_ts: float, bucket_s: int = BUCKET_S) -> tuple[int, int]:
    """(requests, errors) from a counts hash, over buckets that overlap ``since_ts`` or later."""
    requests, errors, _ = read_since(fields, since_ts, bucket_s)
    return requests, errors


def read_since(fields: Mapping[Any, Any], since_ts: float,
               bucket_s: int = BUCKET_S) -> tuple[int, int, list[tuple[str, float, int]]]:
    """(requests, errors, [(user_key, bucket start, errors)]) from a counts hash, over buckets
    that overlap ``since_ts`` or later. Unreadable fields are skipped."""
    first = int(since_ts // bucket_s)
    requests = errors = 0
    users: list[tuple[str, float, int]] = []
    for raw_field, raw_value in fields.items():
        field = raw_field.decode(errors="replace") if isinstance(raw_field, bytes) else str(raw_field)
        kind, _, rest = field.partition(":")
        bucket, _, user = rest.partition(":")
        try:
            value = int(raw_value)
        except ValueError:
            continue
        if not bucket.isdigit() or int(bucket) < first:
            continue
        if kind == "r":
            requests += value
        elif kind == "e":
            errors += value
        elif kind == "u" and user:
            users.append((user, int(bucket) * float(bucket_s), value))
    return requests, errors, users


class ServedCounts:
    """In-memory counts flushed to Redis by a background thread."""

    def __init__(self, client: Any, key_prefix: str, flush_s: float = 1.0,
                 clock: Any = time.time) -> None:
        self._client, self._prefix, self.flush_s, self._clock = client, key_prefix, flush_s, clock
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, str, str], int] = defaultdict(int)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="served-counts", daemon=True)

    def count(self, version: str, arm: str, error: bool, user: str | None = None) -> None:
        bucket = str(int(self._clock() // BUCKET_S))
        with self._lock:
            self._pending[(version, arm, "r:" + bucket)] += 1
            if error:
                self._pending[(version, arm, "e:" + bucket)] += 1
                if user:
                    self._pending[(version, arm, f"u:{bucket}:{user}")] += 1

    def flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, defaultdict(int)
        if not pending:
            return
        try:
            pipe = self._client.pipeline(transaction=False)
            keys = set()
            user_fields: dict[str, int] = defaultdict(int)
            for (version, arm, field), n in pending.items():
                key = served_key(self._prefix, version, arm)
                if field.startswith("u:"):
                    user_fields[key] += 1
                    if user_fields[key] > MAX_USER_FIELDS:
                        continue
                pipe.hincrby(key, field, n)
                keys.add(key)
            for key in keys:
                pipe.expire(key, TTL_S)
            pipe.execute()
        except Exception as exc:  # Redis down: keep the counts for the next flush
            log.warning("could not write served counts to Redis (%s); will retry", exc)
            with self._lock:
                for k, n in pending.items():
                    self._pending[k] += n

    def _run(self) -> None:
        while not self._stop.wait(self.flush_s):
            self.flush()

    def start(self) -> ServedCounts:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self.flush()


def read_counts(client: Any, key_prefix: str, versions: Mapping[str, str], since_ts: float
                ) -> tuple[dict[str, int], dict[str, int], dict[str, list[tuple[str, float, int]]]]:
    """Per arm: requests, errors and errors by (user, bucket) since ``since_ts``; ``versions``
    maps arm -> version."""
    requests: dict[str, int] = {}
    errors: dict[str, int] = {}
    users: dict[str, list[tuple[str, float, int]]] = {}
    for arm, version in versions.items():
        fields = client.hgetall(served_key(key_prefix, version, arm))
        requests[arm], errors[arm], users[arm] = read_since(fields, since_ts)
    return requests, errors, users
