"""The OpenAI API on a local policy: text in and out through the policy's own tokenizer.

A policy directory that holds a Hugging Face tokenizer (``tokenizer.json`` or
``tokenizer_config.json`` in the directory or its ``model/`` folder, as the hf policy saves
it) serves text prompts and chat (through the tokenizer's chat template). A policy without
one (the built-in token-id policy) serves token-id prompts only; its answers carry the
token ids (``text`` is empty) and text prompts are refused with 400.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol, cast

from services.gateway.generation import BadRequestError, GenRequest, Piece

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class Tokenizer(Protocol):
    """What is used of a ``transformers`` tokenizer."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]: ...

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> Any: ...


def find_tokenizer_dir(policy_dir: Path) -> Path | None:
    for candidate in (policy_dir / "model", policy_dir):
        if any((candidate / name).is_file() for name in TOKENIZER_FILES):
            return candidate
    return None


def load_tokenizer(policy_dir: Path) -> Tokenizer | None:
    """The policy's tokenizer, or None when it has none."""
    where = find_tokenizer_dir(policy_dir)
    if where is None:
        return None
    from transformers import AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(str(where))
    return cast(Tokenizer, tokenizer)


def prompt_ids(req: GenRequest, tokenizer: Tokenizer | None) -> list[int]:
    """The token ids of a request's prompt (text and chat need a tokenizer)."""
    if req.kind == "completion" and isinstance(req.prompt, tuple):
        return list(req.prompt)
    if tokenizer is None:
        raise BadRequestError("this model serves token ids only (it has no tokenizer): send `prompt` as a "
                         "list of token ids on /v1/completions")
    if req.kind == "completion":
        return list(tokenizer.encode(str(req.prompt)))
    try:
        ids = tokenizer.apply_chat_template(list(req.messages), tokenize=True, add_generation_prompt=True)
    except Exception as exc:  # no chat template, or one that refuses these messages
        raise BadRequestError(f"the model's chat template cannot render these messages: {exc}") from None
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in newer transformers
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def prefix_texts(tokenizer: Tokenizer, tokens: list[int]) -> list[str]:
    """The decoded text of ``tokens[:k]`` for k = 1..n; each prefix is decoded once and serves
    both the stop-string search and the per-token texts."""
    return [tokenizer.decode(tokens[:k], skip_special_tokens=True) for k in range(1, len(tokens) + 1)]


def cut_at_stop(prefixes: Sequence[str], stops: Sequence[str]) -> int | None:
    """The number of tokens up to and including the one that completes a stop string, or None."""
    for k, text in enumerate(prefixes, start=1):
        if any(s in text for s in stops):
            return k
    return None


def strip_stop(text: str, stops: Sequence[str]) -> str:
    """``text`` up to (not including) the first stop string."""
    cut = min((i for s in stops if (i := text.find(s)) >= 0), default=len(text))
    return text[:cut]


def token_texts(tokenizer: Tokenizer | None, tokens: list[int],
                prefixes: Sequence[str] | None = None) -> list[str]:
    """The text each token adds (incremental decoding, so multi-byte characters come out whole);
    ``prefixes``: :func:`prefix_texts` of ``tokens`` when already computed."""
    if tokenizer is None:
        return ["" for _ in tokens]
    out, before = [], ""
    for now in prefixes if prefixes is not None else prefix_texts(tokenizer, tokens):
        out.append(now[len(before):] if now.startswith(before) else now)
        before = now
    return out


def client_logprobs(kind: str, tokenizer: Tokenizer | None, token: int, text: str, logprob: float,
                    offset: int) -> dict[str, Any]:
    """The OpenAI logprobs object of one token (no alternatives: ``top_logprobs`` is empty)."""
    name = tokenizer.convert_ids_to_tokens([token])[0] if tokenizer is not None else f"token_id:{token}"
    if kind == "chat":
        return {"content": [{"token": name, "logprob": logprob, "bytes": list(text.encode()),
                             "top_logprobs": []}]}
    return {"tokens": [name], "token_logprobs": [logprob], "top_logprobs": None, "text_offset": [offset]}


def pieces(req: GenRequest, tokenizer: Tokenizer | None, prompt: list[int], tokens: list[int],
           logprobs: list[float], eos_ended: bool) -> Iterator[Piece]:
    """One piece per generated token, the prompt ids on the first, the finish reason on the last."""
    prefixes = prefix_texts(tokenizer, tokens) if tokenizer is not None else None
    cut = cut_at_stop(prefixes, req.stop) if prefixes is not None and req.stop else None
    if cut is not None and prefixes is not None:
        tokens, logprobs, prefixes = tokens[:cut], logprobs[:cut], prefixes[:cut]
    texts = token_texts(tokenizer, tokens, prefixes)
    if cut is not None:
        whole = strip_stop("".join(texts), req.stop)
        texts = [_clip(t, i, texts, len(whole)) for i, t in enumerate(texts)]
    finish = "stop" if cut is not None or eos_ended else "length"
    offset = 0
    if not tokens:
        yield Piece(prompt_tokens=prompt, finish_reason=finish)
        return
    for i, (token, lp, text) in enumerate(zip(tokens, logprobs, texts, strict=True)):
        shown = (client_logprobs(req.kind, tokenizer, token, text, lp, offset)
                 if req.logprobs is not None else None)
        yield Piece(text=text, tokens=[token], logprobs=[lp], prompt_tokens=prompt if i == 0 else None,
                    finish_reason=finish if i == len(tokens) - 1 else None, client_logprobs=shown)
        offset += len(text)


def _clip(text: str, index: int, texts: list[str], keep: int) -> str:
    start = sum(len(t) for t in texts[:index])
    return text[: max(0, keep - start)]
