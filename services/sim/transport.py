"""The simulator's I/O pieces: the gateway's HTTP client, the scheduler that sends client
events when they fall due, and the rate limiter the worker threads share."""

from __future__ import annotations

import heapq
import http.client
import itertools
import json
import logging
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from pydantic import BaseModel

from ingest.contracts.prometheus import SIM_EVENTS, SIM_SCHEDULED
from services.runtime.process import Stopper

log = logging.getLogger("rtrl.simulator")


COMPLETIONS = "/v1/completions"
"""The token-id API (and the OpenAI text completions)."""
CHAT = "/v1/chat/completions"


class Gateway(Protocol):
    """What the simulator needs of the gateway (GATEWAY_API.md)."""

    def complete(self, body: dict[str, Any], path: str = COMPLETIONS) -> tuple[int, dict[str, Any]]:
        """POST ``body`` to ``path``; (HTTP status, parsed JSON answer). Raises OSError or
        http.client.HTTPException when the gateway cannot be reached."""
        ...


class GatewayClient:
    """POSTs to the gateway's API with one keep-alive connection per thread."""

    def __init__(self, base_url: str, timeout_s: float, api_key: str | None = None) -> None:
        url = urllib.parse.urlsplit(base_url)
        if url.scheme not in {"http", "https"} or not url.hostname:
            raise ValueError(f"simulator.gateway_url must be http(s)://host:port, got {base_url!r}")
        self._host, self._port = url.hostname, url.port or (443 if url.scheme == "https" else 80)
        self._https = url.scheme == "https"
        self._timeout = timeout_s
        self._local = threading.local()
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"

    def _conn(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            conn = cls(self._host, self._port, timeout=self._timeout)
            self._local.conn = conn
        return conn

    def complete(self, body: dict[str, Any], path: str = COMPLETIONS) -> tuple[int, dict[str, Any]]:
        payload = json.dumps(body).encode()
        for attempt in (0, 1):
            conn = self._conn()
            try:
                conn.request("POST", path, payload, self._headers)
                resp = conn.getresponse()
                data = resp.read()
                try:
                    parsed = json.loads(data) if data else {}
                except ValueError:
                    parsed = {"error": data[:200].decode(errors="replace")}
                return resp.status, parsed
            except (OSError, http.client.HTTPException):
                conn.close()
                self._local.conn = None
                if attempt:
                    raise
        raise AssertionError("unreachable")


@dataclass(order=True)
class _Due:
    at: float
    seq: int
    event: BaseModel = field(compare=False)


class EventScheduler:
    """Sends events when they fall due (a heap and one thread)."""

    def __init__(self, send: Callable[[BaseModel], object]) -> None:
        self._send = send
        self._heap: list[_Due] = []
        self._cv = threading.Condition()
        self._seq = itertools.count()

    def schedule(self, at: datetime, event: BaseModel) -> None:
        with self._cv:
            heapq.heappush(self._heap, _Due(at.timestamp(), next(self._seq), event))
            SIM_SCHEDULED.set(len(self._heap))
            self._cv.notify()

    def pending(self) -> int:
        with self._cv:
            return len(self._heap)

    def run(self, stopper: Stopper, drain_s: float = 30.0) -> int:
        """Send events as they fall due until stopped; then keep sending those due within
        ``drain_s`` of the stop and drop the rest (returned, and logged). Never sends an
        event before its time: its ``ts`` is its due time."""
        stop_at: float | None = None
        while True:
            with self._cv:
                now = time.time()
                if stopper.stopping and stop_at is None:
                    stop_at = now
                if stop_at is not None and (not self._heap or self._heap[0].at > stop_at + drain_s):
                    dropped = len(self._heap)
                    self._heap.clear()
                    SIM_SCHEDULED.set(0)
                    if dropped:
                        log.info("dropped %d client events due more than %.0fs after the stop",
                                 dropped, drain_s)
                    return dropped
                due = []
                while self._heap and self._heap[0].at <= now:
                    due.append(heapq.heappop(self._heap))
                SIM_SCHEDULED.set(len(self._heap))
                if not due:
                    wait = min(0.2, self._heap[0].at - now) if self._heap else 0.2
                    self._cv.wait(max(0.001, wait))
                    continue
            for item in due:
                self._send(item.event)
                SIM_EVENTS.labels(type=getattr(item.event, "type", "?")).inc()


class RateLimiter:
    """Spaces calls evenly at ``rate`` per second across threads (0: no limit)."""

    def __init__(self, rate: float) -> None:
        self._interval = 1.0 / rate if rate > 0 else 0.0
        self._next = time.monotonic()
        self._lock = threading.Lock()

    def wait(self, stopper: Stopper) -> None:
        if not self._interval:
            return
        with self._lock:
            now = time.monotonic()
            slot = max(self._next, now)
            self._next = slot + self._interval
        if slot > now:
            stopper.wait(slot - now)



class GatewayError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message

