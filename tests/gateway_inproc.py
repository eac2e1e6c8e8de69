"""The gateway served in the test's own process (``services/wiring/gateway.build`` and the
ASGI server), with the official ``openai`` client on it: for tests that put the gateway in
front of an upstream engine and read what it logs."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import openai

from services.gateway.asgi.app import GatewayServer
from services.runtime.health import Health
from services.settings.model import Settings
from services.wiring.gateway import build


@contextmanager
def openai_gateway(cfg: Settings, api_key: str, timeout_s: float = 30) -> Iterator[openai.OpenAI]:
    """The gateway of ``cfg`` on a free port, once its stable upstream is available, and a
    client with ``api_key`` (no retries); both stopped on exit."""
    gw, parts = build(cfg, Health())
    server = GatewayServer(gw, "127.0.0.1", 0).start()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=api_key, max_retries=0,
                           timeout=timeout_s)
    try:
        deadline = time.monotonic() + 10
        while gw.slots.get("stable") is None:
            assert time.monotonic() < deadline, "the upstream never became available"
            time.sleep(0.05)
        yield client
    finally:
        client.close()
        server.stop()
        for part in parts:
            part.stop()
