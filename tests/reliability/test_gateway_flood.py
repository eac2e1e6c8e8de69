"""A connection flood cannot starve real users: 2,000 silent connections and 200 slowloris
connections (a header line every second, reconnecting when cut off) from 50 other loopback
addresses, each under the per-client cap, so only the eviction of waiting connections and
the header timeout protect the gateway, while 50 real clients keep requesting, half on
kept-alive connections, half on a new connection per request.

The gateway runs in its own process with its default limits and an instant fake engine, the
flood in another, the real clients here. Bounded in CI (``flood_seconds``); loopback only.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import multiprocessing as mp
import resource
import threading
import time
from typing import Any

import pytest

from tests.reliability import scale

pytestmark = pytest.mark.reliability

SILENT, SLOWLORIS, CLIENTS = 2_000, 200, 50
ATTACKER_ADDRESSES = [f"127.0.1.{i}" for i in range(1, 51)]  # 40-44 connections each: under the cap
REQ = {"user_key": "u1", "session_id": "s1", "prompt_tokens": [0, 7, 8]}


def _serve(port_out: Any, stop: Any) -> None:
    from services.gateway.asgi.app import GatewayServer
    from tests.unit.test_gateway_core import FakeBackend, make

    gateway, _ = make(FakeBackend([5, 6, 1]))
    server = GatewayServer(gateway, "127.0.0.1", 0).start()
    port_out.put(server.port)
    stop.wait()
    server.stop(drain_s=1.0)


async def _hold(port: int, source: str, slow: bool, stop: float) -> None:
    """One attacker connection, reopened whenever the gateway closes it."""
    while time.monotonic() < stop:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
        except OSError:
            await asyncio.sleep(0.05)
            continue
        try:
            if slow:
                writer.write(b"POST /v1/completions HTTP/1.1\r\n")
            while time.monotonic() < stop:
                if slow:
                    writer.write(b"X-Slow: %d\r\n" % int(time.monotonic()))
                    await writer.drain()
                try:
                    if await asyncio.wait_for(reader.read(65536), 1.0) == b"":
                        break  # cut off: come back
                except TimeoutError:
                    continue
        except OSError:
            pass
        finally:
            writer.close()
        await asyncio.sleep(0.01)


def _flood(port: int, seconds: float) -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)

    async def main() -> None:
        stop = time.monotonic() + seconds
        tasks = [_hold(port, ATTACKER_ADDRESSES[i % len(ATTACKER_ADDRESSES)], i >= SILENT, stop)
                 for i in range(SILENT + SLOWLORIS)]
        await asyncio.gather(*tasks)

    asyncio.run(main())


def _client(port: int, keep_alive: bool, until: float, out: list[tuple[bool, float]]) -> None:
    body = json.dumps(REQ).encode()
    headers = {"Content-Type": "application/json"}
    conn: http.client.HTTPConnection | None = None
    while time.monotonic() < until:
        t0 = time.monotonic()
        try:
            if conn is None:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("POST", "/v1/completions", body=body, headers=headers)
            resp = conn.getresponse()
            ok = resp.status == 200 and bool(json.loads(resp.read())["completion_tokens"])
        except (OSError, http.client.HTTPException, ValueError):
            ok = False
            conn = None
        out.append((ok, time.monotonic() - t0))
        if not keep_alive and conn is not None:
            conn.close()
            conn = None
        time.sleep(0.02)


def test_silent_and_slowloris_floods_do_not_starve_real_clients() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 3 * (SILENT + SLOWLORIS):
        pytest.skip(f"the open-file limit ({hard}) is too low for the flood")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    seconds = scale.current().flood_seconds
    ctx = mp.get_context("spawn")
    port_q, stop = ctx.Queue(), ctx.Event()
    gateway = ctx.Process(target=_serve, args=(port_q, stop), daemon=True)
    gateway.start()
    flood = None
    try:
        port = port_q.get(timeout=60)
        flood = ctx.Process(target=_flood, args=(port, seconds + 15), daemon=True)
        flood.start()
        time.sleep(5)  # the flood is in place (its connections opened, the first evictions done)
        results: list[tuple[bool, float]] = []
        until = time.monotonic() + seconds
        threads = [threading.Thread(target=_client, args=(port, i % 2 == 0, until, results), daemon=True)
                   for i in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(seconds + 30)
        metrics = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        metrics.request("GET", "/metrics")
        text = metrics.getresponse().read().decode()
    finally:
        stop.set()
        if flood is not None:
            flood.terminate()
        gateway.join(10)
        if gateway.is_alive():
            gateway.terminate()
    latencies = sorted(s for _, s in results)
    ok = sum(1 for good, _ in results if good)
    closed = {line.split('reason="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
              for line in text.splitlines() if line.startswith("rtrl_gateway_connections_closed_total{")}
    figures = {"requests": len(results), "succeeded": ok,
               "success_ratio": round(ok / max(1, len(results)), 4),
               "p50_s": round(latencies[len(latencies) // 2], 4),
               "p99_s": round(latencies[int(0.99 * (len(latencies) - 1))], 4),
               "closed_by_reason": closed}
    scale.record("gateway_flood", figures)
    assert len(results) > CLIENTS * 10, figures
    assert ok / len(results) >= 0.99, figures
    assert figures["p99_s"] < 1.0, figures
    assert closed.get("evicted", 0) > 0 and closed.get("header_timeout", 0) > 0, figures
