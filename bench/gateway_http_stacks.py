"""Why the gateway uses the standard library's HTTP server: an echo endpoint of the
gateway's size (parse a small JSON body, answer a small JSON body) on
``ThreadingHTTPServer`` (HTTP/1.1 keep-alive, TCP_NODELAY, one write per response, as in
services/gateway/server.py) vs starlette on uvicorn (h11, asyncio), called alternately over one
persistent ``http.client`` connection each, in one run::

    python -m bench.gateway_http_stacks [--requests 3000]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from bench.gateway import percentile

BODY = json.dumps({"user_key": "u", "session_id": "s", "prompt_tokens": list(range(16))}).encode()
RESP = json.dumps({"completion_tokens": list(range(16)), "logprobs": [-0.5] * 16}).encode()


class _Echo(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def do_POST(self) -> None:
        json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(RESP)))
        buffer: list[bytes] = self._headers_buffer  # type: ignore[attr-defined]
        buffer += [b"\r\n", RESP]
        self.flush_headers()

    def log_message(self, format: str, *args: object) -> None:
        return


def start_stdlib() -> int:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return int(srv.server_address[1])


def start_uvicorn() -> int:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    async def echo(request: Request) -> Response:
        json.loads(await request.body())
        return Response(RESP, media_type="application/json")

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    app = Starlette(routes=[Route("/v1/completions", echo, methods=["POST"])])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error",
                                           access_log=False))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return port


def caller(port: int) -> Callable[[], Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port)

    def call() -> Any:
        conn.request("POST", "/v1/completions", body=BODY, headers={"Content-Type": "application/json"})
        return json.loads(conn.getresponse().read())

    return call


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    args = parser.parse_args(argv)
    calls = {"stdlib ThreadingHTTPServer": caller(start_stdlib()),
             "starlette + uvicorn": caller(start_uvicorn())}
    names = list(calls)
    res: dict[str, list[float]] = {n: [] for n in names}
    load = os.getloadavg()[0]
    for i in range(args.requests + 200):
        for name in names if i % 2 else names[::-1]:
            t0 = time.perf_counter()
            calls[name]()
            if i >= 200:
                res[name].append((time.perf_counter() - t0) * 1000)
    print(f"echo round trip, {args.requests} requests each, load average {load:.1f} -> "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    for name, values in res.items():
        print(f"  {name:28s} p50 {percentile(values, 50):6.3f} ms   p99 {percentile(values, 99):6.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
