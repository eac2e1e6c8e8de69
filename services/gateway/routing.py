"""The gateway's view of the routing table: read from Redis every ``poll_s`` seconds.

The deployer writes ``{prefix}routing:{canary_weight,salt,stable_version,canary_version}``
(deployer/routing.py); :class:`RoutingPoller` reads them with one MGET, resolves the
stable version (the registry's ``champion`` alias when Redis names none, re-read at most
every ``champion_refresh_s``) and tells :class:`ModelSlots` which versions to serve. A
weight change therefore takes effect within one poll, without restart.

When Redis is unreachable the last table read stays in force (the split does not flap
to "all stable" during a Redis blip); ``rtrl_gateway_routing_age_seconds`` grows and
``GATEWAY_ERRORS{kind="routing"}`` counts the failed reads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from deployer.routing import RoutingTable, parse_table
from ingest.contracts.keys import ROUTING_FIELDS, routing_keys
from ingest.contracts.prometheus import DEPENDENCY_RETRIES, GATEWAY_ERRORS, GATEWAY_ROUTING_AGE

log = logging.getLogger(__name__)


class RoutingSource(Protocol):
    def read(self) -> RoutingTable: ...


class RedisRoutingSource:
    """Reads the routing keys under ``key_prefix`` from Redis."""

    def __init__(self, client: object, key_prefix: str) -> None:
        self._client = client
        self._keys = routing_keys(key_prefix)

    def read(self) -> RoutingTable:
        values = self._client.mget([self._keys[f] for f in ROUTING_FIELDS])  # type: ignore[attr-defined]
        return parse_table(dict(zip(ROUTING_FIELDS, values, strict=True)))


class ChampionCache:
    """The registry's champion version, re-read at most every ``refresh_s`` seconds."""

    def __init__(self, lookup: Callable[[], str | None], refresh_s: float = 10.0) -> None:
        self._lookup = lookup
        self._refresh_s = refresh_s
        self._value: str | None = None
        self._read_at = -float("inf")

    def get(self) -> str | None:
        now = time.monotonic()
        if now - self._read_at >= self._refresh_s:
            self._read_at = now
            try:
                self._value = self._lookup()
            except Exception as exc:  # keep the last known champion through a registry blip
                GATEWAY_ERRORS.labels("stable", self._value or "none", "registry").inc()
                DEPENDENCY_RETRIES.labels("gateway", "mlflow").inc()
                log.warning("could not read the champion alias: %s", exc)
        return self._value


class RoutingPoller:
    """Polls the routing table and keeps the wanted model versions up to date."""

    def __init__(
        self,
        source: RoutingSource,
        on_table: Callable[[RoutingTable, str | None], None],
        champion: Callable[[], str | None] | None = None,
        poll_s: float = 1.0,
        beat: Callable[[], None] | None = None,
    ) -> None:
        self._source = source
        self._on_table = on_table
        self._champion = champion
        self._poll_s = poll_s
        self._beat = beat
        self.table = RoutingTable()
        """The table in force (replaced atomically; request threads read it without a lock)."""
        self.stable_version: str | None = None
        self.read_at: float | None = None
        self._last_problems: tuple[str, ...] = ()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll_once(self) -> RoutingTable:
        try:
            table = self._source.read()
        except Exception as exc:
            GATEWAY_ERRORS.labels("none", "none", "routing").inc()
            DEPENDENCY_RETRIES.labels("gateway", "redis").inc()
            log.warning("routing table unreadable, keeping the last one: %s", exc)
        else:
            if table.problems and table.problems != self._last_problems:
                log.error("routing table: %s", "; ".join(table.problems))
            self._last_problems = table.problems
            self.table = table
            self.read_at = time.monotonic()
        stable = self.table.stable_version
        if stable is None and self._champion is not None:
            stable = self._champion()
        self.stable_version = stable
        self._on_table(self.table, stable)
        if self.read_at is not None:
            GATEWAY_ROUTING_AGE.set(time.monotonic() - self.read_at)
        return self.table

    def start(self) -> RoutingPoller:
        def run() -> None:
            while not self._stop.is_set():
                try:
                    self.poll_once()
                except Exception:
                    log.exception("routing poll failed")
                if self._beat is not None:
                    self._beat()
                self._stop.wait(self._poll_s)

        self._thread = threading.Thread(target=run, name="routing-poller", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
