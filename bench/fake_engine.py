"""A stand-in for a vLLM server that costs almost no CPU: the engine of
``rtrl bench gateway --mode vllm --fake-engine``, which measures the gateway's own relay cost
(parsing the engine's chunks, re-encoding them for the client, logging the exposure) apart
from an engine competing for the same cores.

``POST /v1/chat/completions`` and ``POST /v1/completions`` answer ``max_tokens`` tokens in
vLLM's shape with ``return_token_ids`` (``prompt_token_ids``, per-choice ``token_ids``, chat
``logprobs.content`` or completion ``logprobs.token_logprobs``), whole or streamed as
server-sent events, one event per token. Each token takes ``token_ms`` (a sleep, not work),
like an engine's decode step.

A chat request that declares ``tools`` (and a ``tool_choice`` other than ``none``) is answered
with one tool call instead of text, as vLLM answers one: to the function ``tool_choice``
names, else the first declared; its ``arguments`` are the text of the last user message, so
a test decides whether they are valid; its id is new per answer (``call_`` + 24 hex).
Streamed, the call comes as OpenAI's deltas: the first with its id and name, then the
arguments in pieces, one token each; the answer ends with ``finish_reason: tool_calls``.
"""

from __future__ import annotations

import json
import time
import uuid
from http.server import BaseHTTPRequestHandler
from typing import Any

from bench.fake_upstream import JsonHandler, LoopbackServer

PROMPT_IDS = [1, 5, 9, 14]


class FakeEngine(LoopbackServer):
    def __init__(self, token_ms: float = 1.0) -> None:
        self.token_s = token_ms / 1000
        self.connections = 0
        self.posts = 0
        """Connections opened to it and generation requests received (what a client costs it)."""
        super().__init__(self._handler(), "fake-engine")

    @property
    def base_url(self) -> str:
        return self.url

    @staticmethod
    def choice(chat: bool, ids: list[int], final: bool, delta: bool) -> dict[str, Any]:
        text = "".join(f" w{i}" for i in ids)
        lps = [-0.5] * len(ids)
        out: dict[str, Any] = {"index": 0, "token_ids": ids, "finish_reason": "length" if final else None}
        if chat:
            out["delta" if delta else "message"] = {"role": "assistant", "content": text}
            out["logprobs"] = {"content": [{"token": f"w{i}", "logprob": lp, "top_logprobs": []}
                                           for i, lp in zip(ids, lps, strict=True)]}
        else:
            out["text"] = text
            out["logprobs"] = {"tokens": [f"w{i}" for i in ids], "token_logprobs": lps}
        return out

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        return type("Handler", (_Handler,), {"fake": self})


class _Handler(JsonHandler):
    fake: FakeEngine

    def setup(self) -> None:
        super().setup()
        self.fake.connections += 1

    def do_GET(self) -> None:  # noqa: N802 (http.server names its handlers so)
        self.answer({"object": "list", "data": [{"id": "base", "object": "model"}]})

    def do_POST(self) -> None:  # noqa: N802 (http.server names its handlers so)
        req = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
        self.fake.posts += 1
        chat = self.path.endswith("/chat/completions")
        if chat and req.get("tools") and req.get("tool_choice") != "none":
            self._tool_call(req)
            return
        n = int(req.get("max_tokens") or 16)
        ids = [3 + (int(req.get("seed") or 0) + i) % 60 for i in range(n)]
        head = {"id": "cmpl-fake", "model": req.get("model"), "created": int(time.time()),
                "object": "chat.completion" if chat else "text_completion"}
        if not req.get("stream"):
            time.sleep(self.fake.token_s * n)
            whole = {**self.fake.choice(chat, ids, True, False), "prompt_token_ids": PROMPT_IDS}
            self.answer({**head, "prompt_token_ids": PROMPT_IDS, "choices": [whole]})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if chat:
            opening = {"index": 0, "delta": {"role": "assistant", "content": ""}, "token_ids": [],
                       "prompt_token_ids": PROMPT_IDS}
            self._event({**head, "prompt_token_ids": PROMPT_IDS, "choices": [opening]})
        for k, tok in enumerate(ids):
            time.sleep(self.fake.token_s)
            self._event({**head, "choices": [self.fake.choice(chat, [tok], k == n - 1, True)],
                         **({} if chat or k else {"prompt_token_ids": PROMPT_IDS})})
        self._chunk(b"data: [DONE]\n\n")
        self._chunk(b"")

    def _tool_call(self, req: dict[str, Any]) -> None:
        whole, events = tool_call_answer(req)
        if not req.get("stream"):
            self.answer(whole)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for event in events:
            self._event(event)
        self._chunk(b"data: [DONE]\n\n")
        self._chunk(b"")

    def _event(self, data: dict[str, Any]) -> None:
        self._chunk(b"data: " + json.dumps(data).encode() + b"\n\n")

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()


def tool_call_answer(req: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The whole answer and the stream events of a tool call to ``req`` (the module doc)."""
    choice = req.get("tool_choice")
    name = choice["function"]["name"] if isinstance(choice, dict) else req["tools"][0]["function"]["name"]
    users = [m for m in req["messages"] if m.get("role") == "user"]
    arguments = str(users[-1].get("content") or "") if users else ""
    parts = [arguments[i:i + 8] for i in range(0, len(arguments), 8)] or [""]
    ids = [3 + i % 60 for i in range(len(parts))]
    lps = [{"token": f"w{i}", "logprob": -0.5, "top_logprobs": []} for i in ids]
    head = {"id": "chatcmpl-fake", "model": req.get("model"), "created": int(time.time()),
            "prompt_token_ids": PROMPT_IDS}
    call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": ""}}
    message = {"role": "assistant", "content": None,
               "tool_calls": [{**call, "function": {"name": name, "arguments": arguments}}]}
    whole = {**head, "object": "chat.completion", "choices": [{
        "index": 0, "message": message, "token_ids": ids, "logprobs": {"content": lps},
        "finish_reason": "tool_calls", "prompt_token_ids": PROMPT_IDS}]}
    head["object"] = "chat.completion.chunk"
    opening = {"role": "assistant", "content": None, "tool_calls": [{"index": 0, **call}]}
    first = {"index": 0, "delta": opening, "token_ids": [], "finish_reason": None}
    events: list[dict[str, Any]] = [{**head, "choices": [first]}]
    for k, (part, tok) in enumerate(zip(parts, ids, strict=True)):
        events.append({**head, "choices": [{
            "index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": part}}]},
            "token_ids": [tok], "logprobs": {"content": [lps[k]]},
            "finish_reason": "tool_calls" if k == len(parts) - 1 else None}]})
    return whole, events
