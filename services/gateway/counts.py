"""Served and failed requests per (model version, arm), shared through Redis.

A failed request never produces a reward record, so the judge's error-rate guardrail needs
the gateway's own counts. The gateway counts in memory (nothing on the request path) and a
background thread adds the counts to Redis every ``flush_s``; the deployer sums them since
its canary started.

Keys: ``{prefix}gateway:served:{version}:{arm}``, a hash with fields ``r:{bucket}``
(requests) and ``e:{bucket}`` (errors), where a bucket is ``ts // BUCKET_S``. Time buckets
let the deployer count "since the canary started" without a baseline snapshot; keys expire
after ``TTL_S`` without traffic. The canary arm is counted by assignment: a canary request
that failed and was then served by stable counts as one canary request and one canary error.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)

BUCKET_S = 10
TTL_S = 8 * 86_400


def served_key(prefix: str, version: str, arm: str) -> str:
    return f"{prefix}gateway:served:{version}:{arm}"


def sum_since(fields: Mapping[Any, Any], since_ts: float, bucket_s: int = BUCKET_S) -> tuple[int, int]:
    """(requests, errors) from a counts hash, over buckets that overlap ``since_ts`` or later."""
    first = int(since_ts // bucket_s)
    requests = errors = 0
    for raw_field, raw_value in fields.items():
        field = raw_field.decode() if isinstance(raw_field, bytes) else str(raw_field)
        kind, _, bucket = field.partition(":")
        if not bucket.isdigit() or int(bucket) < first:
            continue
        if kind == "r":
            requests += int(raw_value)
        elif kind == "e":
            errors += int(raw_value)
    return requests, errors


class ServedCounts:
    """In-memory counts flushed to Redis by a background thread."""

    def __init__(self, client: Any, key_prefix: str, flush_s: float = 1.0,
                 clock: Any = time.time) -> None:
        self._client, self._prefix, self.flush_s, self._clock = client, key_prefix, flush_s, clock
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, str, str], int] = defaultdict(int)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="served-counts", daemon=True)

    def count(self, version: str, arm: str, error: bool) -> None:
        bucket = str(int(self._clock() // BUCKET_S))
        with self._lock:
            self._pending[(version, arm, "r:" + bucket)] += 1
            if error:
                self._pending[(version, arm, "e:" + bucket)] += 1

    def flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, defaultdict(int)
        if not pending:
            return
        try:
            pipe = self._client.pipeline(transaction=False)
            keys = set()
            for (version, arm, field), n in pending.items():
                key = served_key(self._prefix, version, arm)
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


def read_counts(client: Any, key_prefix: str, versions: Mapping[str, str],
                since_ts: float) -> tuple[dict[str, int], dict[str, int]]:
    """Per arm (requests, errors) since ``since_ts``; ``versions`` maps arm -> version."""
    requests: dict[str, int] = {}
    errors: dict[str, int] = {}
    for arm, version in versions.items():
        fields = client.hgetall(served_key(key_prefix, version, arm))
        requests[arm], errors[arm] = sum_since(fields, since_ts)
    return requests, errors
