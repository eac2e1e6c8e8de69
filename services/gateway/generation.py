"""What the OpenAI-compatible API asks of a backend, and what comes back.

A backend turns a :class:`GenRequest` into an iterator of :class:`Piece` s: one piece per
streamed step (a local policy yields one per token; an engine one per server-sent chunk).
:class:`Served` accumulates the pieces into what the answer and the exposure event need:
the exact prompt and completion token ids and the per-token log-probabilities *as the
backend served them* (never re-tokenized text).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from services.gateway.chat import calls

Kind = Literal["completion", "chat"]


@dataclass(frozen=True)
class GenRequest:
    """One generation, in the terms of the OpenAI API (validated by services/gateway/openai_api.py)."""

    kind: Kind
    max_tokens: int
    temperature: float = 1.0
    prompt: str | tuple[int, ...] | None = None
    """Completions: text or token ids."""
    messages: tuple[dict[str, Any], ...] = ()
    """Chat: the messages, passed to the model's chat template."""
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: int | None = None
    """Top alternatives per token the client asked for (completions ``logprobs``, chat
    ``top_logprobs`` when ``logprobs`` is true); None: the client gets no logprobs."""
    tools: tuple[dict[str, Any], ...] = ()
    """Chat: the declared tools, checked (services/gateway/chat/declared.py), for the engine."""
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


@dataclass
class Piece:
    """One step of a generation."""

    text: str = ""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    """Log-probability of each token in ``tokens`` under the distribution sampled from."""
    finish_reason: str | None = None
    prompt_tokens: list[int] | None = None
    """The prompt as the backend tokenized it (set on the first piece that knows it)."""
    client_logprobs: Any = None
    """The logprobs object to show the client for this piece (OpenAI shape), if any."""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    """Chat: tool-call deltas in OpenAI's stream shape (services/gateway/chat/calls.py)."""
    refusal: str | None = None


@dataclass
class Served:
    """All pieces of one generation, accumulated."""

    prompt_tokens: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    client_logprobs: list[Any] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    """The tool calls assembled from the pieces' deltas."""
    refusal: str | None = None

    def add(self, piece: Piece) -> None:
        if piece.prompt_tokens is not None and not self.prompt_tokens:
            self.prompt_tokens = list(piece.prompt_tokens)
        self.tokens.extend(piece.tokens)
        self.logprobs.extend(piece.logprobs)
        if piece.text:
            self.text_parts.append(piece.text)
        if piece.finish_reason is not None:
            self.finish_reason = piece.finish_reason
        if piece.client_logprobs is not None:
            self.client_logprobs.append(piece.client_logprobs)
        if piece.tool_calls:
            calls.merge(self.tool_calls, piece.tool_calls)
        if piece.refusal:
            self.refusal = (self.refusal or "") + piece.refusal

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def problem(self) -> str | None:
        """Why these pieces cannot make a valid exposure event (None: they can)."""
        if not self.prompt_tokens:
            return "the backend did not return the prompt's token ids"
        if len(self.tokens) != len(self.logprobs):
            return f"the backend returned {len(self.tokens)} tokens but {len(self.logprobs)} logprobs"
        return None


LOGPROB_FLOOR = -1000.0
"""A log-probability that is missing or -inf is logged as this (the contract needs a finite number)."""


def clean_logprob(value: object) -> float:
    if not isinstance(value, int | float) or value != value:  # None or NaN
        return LOGPROB_FLOOR
    return max(LOGPROB_FLOOR, min(0.0, float(value)))


class UpstreamError(Exception):
    """The upstream failed; ``status`` is the code the gateway answers with (502 or 504)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class BadRequestError(Exception):
    """The request cannot be served by this backend (-> 400 with this message)."""
