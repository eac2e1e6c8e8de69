"""Client-supplied request ids are used once: a repeated one is refused (409).

A ``request_id`` names one served completion: the reward join keeps one exposure per id, so
a second completion under the same id would be logged and then silently dropped from
training. Ids the gateway generates are random (128 bits) and never checked. An id a
client supplies is claimed with ``SET {prefix}gateway:rid:{id} 1 NX EX ttl`` in Redis, so
the rule holds across gateway replicas; while Redis is unreachable the gateway falls back
to its own memory of the last ``local_size`` ids (the rule then holds per replica) and
counts ``rtrl_gateway_errors_total{kind="request_ids"}``.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any

from ingest.contracts.keys import request_id_key
from ingest.contracts.prometheus import GATEWAY_ERRORS

log = logging.getLogger(__name__)

TTL_S = 8 * 86_400
"""Longer than any reward horizon: within it an id cannot be reused."""


class RequestIds:
    def __init__(self, client: Any | None, key_prefix: str, ttl_s: int = TTL_S,
                 local_size: int = 100_000) -> None:
        self._client = client
        self._prefix = key_prefix
        self._ttl_s = ttl_s
        self._local: OrderedDict[str, None] = OrderedDict()
        self._local_size = local_size
        self._lock = threading.Lock()

    @property
    def remote(self) -> bool:
        """True when claims go to Redis (a network round trip)."""
        return self._client is not None

    def _claim_local(self, request_id: str) -> bool:
        with self._lock:
            if request_id in self._local:
                return False
            self._local[request_id] = None
            while len(self._local) > self._local_size:
                self._local.popitem(last=False)
            return True

    def claim(self, request_id: str) -> bool:
        """True the first time ``request_id`` is seen; False when it was already served."""
        if self._client is None:
            return self._claim_local(request_id)
        try:
            claimed = self._client.set(request_id_key(self._prefix, request_id), b"1",
                                       nx=True, ex=self._ttl_s)
        except Exception as exc:
            GATEWAY_ERRORS.labels("none", "none", "request_ids").inc()
            log.warning("could not claim a request id in Redis (%s); checked in memory only", exc)
            return self._claim_local(request_id)
        if claimed:  # remembered here too, for when Redis is unreachable later
            self._claim_local(request_id)
        return bool(claimed)

    def release(self, request_id: str) -> None:
        """Forget a claimed id whose request failed, so the client may retry with it."""
        with self._lock:
            self._local.pop(request_id, None)
        if self._client is None:
            return
        try:
            self._client.delete(request_id_key(self._prefix, request_id))
        except Exception as exc:
            log.warning("could not release request id in Redis: %s", exc)
