"""A tiny OpenAI-compatible completions server: the stand-in for a team's inference server
in the gateway benchmark and the upstream-mode tests.

``POST /v1/completions`` answers ``max_tokens`` tokens (ids derived from the prompt, so
answers are deterministic) with ``logprobs.tokens`` as vLLM's ``"token_id:N"`` strings
(or as text when ``text_tokens`` is set) and ``token_logprobs`` of -0.5. Every request
body is kept in ``requests`` for assertions.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self


class _Backlogged(ThreadingHTTPServer):
    """The stdlib server's listen backlog is 5: 64 clients connecting at once overflow it and
    get connection resets, which a stand-in for an engine must not add to the measurement."""

    request_queue_size = 1024


class LoopbackServer:
    """A threaded HTTP server on a free loopback port, serving ``handler`` until ``stop``."""

    def __init__(self, handler: type[BaseHTTPRequestHandler], name: str) -> None:
        self._server = _Backlogged(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name=name, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> Self:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class JsonHandler(BaseHTTPRequestHandler):
    """Keep-alive HTTP/1.1 without Nagle or access logs, answering JSON with ``answer``."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def answer(self, data: Any, status: int = 200) -> None:
        payload = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: object) -> None:
        return


class FakeCompletionsServer(LoopbackServer):
    def __init__(self, delay_s: float = 0.0, text_tokens: bool = False, status: int = 200) -> None:
        self.delay_s = delay_s
        self.text_tokens = text_tokens
        self.status = status
        self.requests: list[dict[str, Any]] = []
        super().__init__(self._handler(), "fake-upstream")

    def answer(self, req: dict[str, Any]) -> dict[str, Any]:
        prompt = req.get("prompt") or [0]
        n = int(req.get("max_tokens") or 16)
        ids = [3 + (sum(prompt) + i) % 60 for i in range(n)]
        tokens = [f"w{i}" if self.text_tokens else f"token_id:{i}" for i in ids]
        return {
            "id": "cmpl-fake", "object": "text_completion", "model": req.get("model"),
            "choices": [{"index": 0, "text": " ".join(tokens), "finish_reason": "length",
                         "logprobs": {"tokens": tokens, "token_logprobs": [-0.5] * n}}],
        }

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(JsonHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                req = json.loads(body)
                req["_authorization"] = self.headers.get("Authorization")
                fake.requests.append(req)
                if fake.delay_s:
                    time.sleep(fake.delay_s)
                self.answer(fake.answer(req) if fake.status == 200 else {"error": "fake"}, fake.status)

        return Handler
