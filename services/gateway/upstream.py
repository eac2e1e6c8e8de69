"""Upstream mode: the gateway forwards each arm to an OpenAI-compatible inference server.

The request sent to ``{base_url}/v1/completions`` is::

    {"model": <model>, "prompt": [<token ids>], "max_tokens": n, "temperature": t,
     "logprobs": 1, "return_tokens_as_token_ids": true}

Token-id prompts are part of the OpenAI completions API; ``return_tokens_as_token_ids``
is vLLM's switch that makes ``choices[0].logprobs.tokens`` come back as ``"token_id:123"``
strings. The gateway reads the sampled tokens and ``token_logprobs`` from there, so the
served event carries real token ids and the server's behavior log-probabilities.

Servers that return text tokens instead are handled by ``token_ids``:

* ``require`` (default): the request fails with 502 and a message saying how to fix the
  server; training on made-up ids would be worse than no data.
* ``hash``: each text token becomes ``blake2b(token, 4 bytes) & 0x7fffffff``, a stable id
  that keeps the event valid and the exposure attributable; such ids are fine for the
  judge and the rewards but not for training a policy on them.

A logprob that is missing or ``-inf`` is logged as ``LOGPROB_FLOOR``; positive values
(rounding) are clipped to 0, so the event always satisfies the contract.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from typing import Any, Literal

from services.gateway.engine_backend import EngineBackend, EngineClient, Relay
from services.gateway.generation import GenRequest, Piece, UpstreamError, clean_logprob
from services.gateway.models import Generation
from services.settings.services import UpstreamSettings

TOKEN_ID_PREFIX = "token_id:"  # noqa: S105 (vLLM's token id marker, not a secret)


def token_id(token: str, mode: Literal["require", "hash"]) -> int:
    """The id of one upstream token string (``"token_id:123"`` or text, per ``mode``)."""
    if token.startswith(TOKEN_ID_PREFIX):
        try:
            return int(token[len(TOKEN_ID_PREFIX):])
        except ValueError:
            pass
    if mode == "hash":
        digest = hashlib.blake2b(token.encode("utf-8"), digest_size=4).digest()
        return int.from_bytes(digest, "big") & 0x7FFFFFFF
    raise UpstreamError(
        502,
        f"upstream returned text token {token[:40]!r} instead of a token id; enable "
        "return_tokens_as_token_ids on the server (vLLM) or set RTRL_GATEWAY__UPSTREAM_TOKEN_IDS=hash",
    )


def parse_completion(data: Any, mode: Literal["require", "hash"]) -> Generation:
    """Tokens and logprobs of the first choice of an OpenAI completions response."""
    try:
        choice = data["choices"][0]
    except (KeyError, IndexError, TypeError):
        raise UpstreamError(502, "upstream response has no choices") from None
    lp = choice.get("logprobs") if isinstance(choice, dict) else None
    if not isinstance(lp, dict) or not isinstance(lp.get("tokens"), list):
        raise UpstreamError(502, "upstream response has no logprobs.tokens; does it support logprobs?")
    tokens = [token_id(str(t), mode) for t in lp["tokens"]]
    raw = lp.get("token_logprobs")
    raw_list = raw if isinstance(raw, list) else []
    logprobs = [clean_logprob(raw_list[i] if i < len(raw_list) else None) for i in range(len(tokens))]
    return Generation(tokens=tokens, logprobs=logprobs)


class UpstreamBackend:
    """Forwards generations to one OpenAI-compatible endpoint over persistent connections
    (one per gateway thread)."""

    vocab_size: int | None = None

    def __init__(
        self,
        cfg: UpstreamSettings,
        timeout_s: float = 30.0,
        token_ids: Literal["require", "hash"] = "require",  # noqa: S107 (a mode, not a secret)
        relay: Callable[[str, str | None, float], Relay] | None = None,
    ) -> None:
        self._cfg = cfg
        self._mode = token_ids
        key = cfg.api_key.get_secret_value() if cfg.api_key is not None else None
        self._client = EngineClient(cfg.base_url, key, timeout_s, name="upstream")
        """Persistent connections, one per gateway thread, shared by both APIs."""
        self._relay = relay(cfg.base_url, key, timeout_s) if relay is not None else None
        """``relay(base_url, api_key, timeout_s)``: the asynchronous client for the event loop."""
        self._engine = EngineBackend(self._client, cfg.model, self._relay)
        self.relays = self._relay is not None

    def generate(self, prompt_tokens: Sequence[int], max_tokens: int, temperature: float) -> Generation:
        status, payload = self._client.exchange("POST", "/v1/completions", {
            "model": self._cfg.model, "prompt": list(prompt_tokens), "max_tokens": max_tokens,
            "temperature": temperature, "logprobs": 1, "return_tokens_as_token_ids": True,
        })
        if status != 200:
            detail = payload[:200].decode("utf-8", "replace")
            raise UpstreamError(502, f"upstream answered {status}: {detail}")
        try:
            data = json.loads(payload)
        except ValueError:
            raise UpstreamError(502, "upstream answered with invalid JSON") from None
        return parse_completion(data, self._mode)

    def stream(self, req: GenRequest, stream: bool = True) -> Iterator[Piece]:
        """The OpenAI API, forwarded as in the ``vllm`` backend (services/gateway/engine_backend.py)."""
        return self._engine.stream(req, stream)

    def astream(self, req: GenRequest, stream: bool = True) -> AsyncGenerator[Piece, None]:
        return self._engine.astream(req, stream)

    def close(self) -> None:
        self._client.close()
        if self._relay is not None:
            self._relay.close()
