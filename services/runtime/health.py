"""Health and metrics endpoints every rtrl service exposes.

``/metrics`` serves the Prometheus registry, ``/healthz`` answers 200 while the process
loop is alive (it is stale when the loop has not ticked within ``liveness_timeout_s``), and
``/readyz`` answers 200 only when every required readiness check passes (e.g. broker
reachable, partitions assigned). Each failing check is named in the body so on-call can see
why; an advisory check (``required=False``) is named under ``degraded`` when it fails but
never takes the process out of its Service (the gateway answers without the broker).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)


class Health:
    """Liveness heartbeat and named readiness checks for one process."""

    def __init__(self, liveness_timeout_s: float = 60.0) -> None:
        self._checks: dict[str, Callable[[], bool]] = {}
        self._advisory: set[str] = set()
        self._beats: dict[str, float] = {"": time.monotonic()}
        self.liveness_timeout_s = liveness_timeout_s

    def beat(self, loop: str = "") -> None:
        """Called by the main loop on every iteration; a process with several loops names
        each, and is live only while every one of them ticks."""
        self._beats[loop] = time.monotonic()

    def add_check(self, name: str, check: Callable[[], bool], required: bool = True) -> None:
        self._checks[name] = check
        if not required:
            self._advisory.add(name)

    def live(self) -> tuple[bool, dict[str, object]]:
        age = time.monotonic() - min(self._beats.values())
        return age <= self.liveness_timeout_s, {"last_loop_s_ago": round(age, 3)}

    def ready(self) -> tuple[bool, dict[str, object]]:
        failing = []
        for name, check in self._checks.items():
            try:
                ok = bool(check())
            except Exception:  # a check that raises is a failing check, never a crash
                ok = False
            if not ok:
                failing.append(name)
        required = [n for n in failing if n not in self._advisory]
        body: dict[str, object] = {"failing": required, "checks": sorted(self._checks)}
        if len(required) < len(failing):
            body["degraded"] = [n for n in failing if n in self._advisory]
        return not required, body


class HttpEndpoints:
    """A small threaded HTTP server for /metrics, /healthz and /readyz."""

    def __init__(
        self,
        health: Health,
        host: str = "127.0.0.1",
        port: int = 0,
        registry: CollectorRegistry = REGISTRY,
    ) -> None:
        handler = _make_handler(health, registry)
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="http", daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> HttpEndpoints:
        self._thread.start()
        log.info("metrics and health on http://%s:%d", self._server.server_address[0], self.port)
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _make_handler(health: Health, registry: CollectorRegistry) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            elif path == "/healthz":
                ok, body = health.live()
                self._json(200 if ok else 503, {"ok": ok, **body})
            elif path == "/readyz":
                ok, body = health.ready()
                self._json(200 if ok else 503, {"ok": ok, **body})
            else:
                self._json(404, {"error": f"no such path {path}"})

        def _json(self, code: int, body: dict[str, object]) -> None:
            self._send(code, json.dumps(body).encode(), "application/json")

        def _send(self, code: int, payload: bytes, ctype: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: object) -> None:
            return  # scrapes every few seconds would flood the log

    return Handler
