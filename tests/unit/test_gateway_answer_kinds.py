"""The ``completion_kind`` the gateway logs for ``/v1/completions``: the completion text is read
by the chat answers' classifier (services/gateway/chat/classify.py), whole and streamed; ids
without text stay an edit. Through the routes, with the fakes of test_gateway_openai.py."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from services.gateway.generation import GenRequest, Piece
from services.gateway.models import Generation
from tests.unit.test_gateway_openai import CHAT, COMPLETION, call, make

pytestmark = pytest.mark.unit


class TextBackend:
    """Serves one fixed answer: each text part one token (no text: ids only), then a finish."""

    vocab_size = None

    def __init__(self, parts: Sequence[str], finish: str = "stop", tokens: int | None = None) -> None:
        self.parts, self.finish = list(parts), finish
        self.tokens = len(self.parts) if tokens is None else tokens

    def generate(self, prompt_tokens: Sequence[int], max_tokens: int, temperature: float) -> Generation:
        return Generation([5] * self.tokens, [-0.5] * self.tokens)

    def stream(self, req: GenRequest, stream: bool = True) -> Iterator[Piece]:
        yield Piece(prompt_tokens=[7, 8])
        texts = self.parts + [""] * (self.tokens - len(self.parts))
        for i, text in enumerate(texts):
            yield Piece(text=text, tokens=[10 + i], logprobs=[-0.5])
        yield Piece(finish_reason=self.finish)

    def close(self) -> None:
        pass


def _kind(backend: TextBackend, stream: bool, path: str = "/v1/completions",
          body: dict[str, Any] = COMPLETION) -> str:
    gw, logged, _ = make(backend)
    resp, _ = call(gw, path, {**body, "stream": stream})
    assert resp.code == 200
    [event] = logged
    return str(event["completion_kind"])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("parts", "finish", "kind"), [
    (["Which file", " do you mean?"], "stop", "question"),
    (["how", " should errors be reported"], "length", "question"),
    (["```python\n", "xs.sort()\n```\n", "Also update the tests?"], "stop", "edit"),
    (["Replace the loop", " with sum(xs)."], "stop", "edit"),
    ([" ", "\n"], "stop", "empty"),
    (["partial"], "content_filter", "empty"),
    (["I'm sorry, but", " I can't help with that."], "stop", "empty"),
    (["I can't reproduce this,", " but the fix is sorted(xs)."], "stop", "edit"),
])
def test_a_completion_is_classified_by_its_text(parts: list[str], finish: str, kind: str,
                                                stream: bool) -> None:
    assert _kind(TextBackend(parts, finish), stream) == kind


@pytest.mark.parametrize("stream", [False, True])
def test_token_ids_without_text_cannot_be_read_and_stay_an_edit(stream: bool) -> None:
    assert _kind(TextBackend([], tokens=3), stream) == "edit"
    assert _kind(TextBackend([], "content_filter", tokens=3), stream) == "empty"


def test_a_completion_of_nothing_is_empty() -> None:
    assert _kind(TextBackend([]), stream=False) == "empty"


def test_the_same_text_is_the_same_kind_on_both_routes() -> None:
    for parts in (["Which", " one?"], ["Use sorted()."]):
        chat = _kind(TextBackend(parts), False, "/v1/chat/completions", CHAT)
        assert _kind(TextBackend(parts), False) == chat
