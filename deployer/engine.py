"""Candidates on the inference engine: loaded and checked before any traffic, unloaded after.

With an engine (``RTRL_ENGINE__KIND=vllm``), a model version is served as a model name on
the engine. Before a canary takes its first step the deployer *ensures* its version is
loaded: the version's adapter is fetched from the registry into the shared adapter
directory, loaded with the engine's runtime LoRA API, a warm-up request is sent, and the
engine's greedy answer to a fixed prompt, with its log-probabilities, is compared with the
candidate's own (written next to the adapter at registration, ``engine_check.json``). Only a
version that passed is recorded under ``{prefix}engine:model:{version}``, which is what lets
the gateway route to it. A version that fails to load or check is rolled back with the reason in the ledger.
Rolled-back and superseded versions are unloaded.

This module holds the port and the pure rules; deployer/adapters/vllm_engine.py talks HTTP.

Artifact layout of a version the engine serves (the registered model version's files)::

    policy.json            the manifest (any kind)
    adapter/               a PEFT LoRA adapter (adapter_config.json, adapter_model.safetensors)
    engine_check.json      {"prompt_token_ids": [...], "prompt_logprobs": [null, -2.1, ...],
                            "greedy": {"token_ids": [...], "logprobs": [...], "margins": [...]}}

A version whose manifest says ``{"engine": "base"}`` is the engine's base model itself.

The check is a greedy continuation, not the prompt's log-probabilities: vLLM's CPU build
(0.32) kills its engine when a LoRA request asks for ``prompt_logprobs`` while other requests
share its batch (vllm-project/vllm#16668), which live traffic always does. A version
registered before ``greedy`` was written is still checked by its prompt log-probabilities.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ingest.contracts.registry import ADAPTER_DIR, CHECK_FILE

READY = "ready"
FAILED = "failed"
CHECK_TEXT = "def add(a, b):\n    return a + b\n"
"""The fixed prompt a version's own log-probabilities are written for (under its tokenizer)."""
CHECK_TOKENS = 8
"""Tokens of the greedy continuation the engine must reproduce (end of text ignored)."""


class EngineCheckError(Exception):
    """The version cannot be served (a bad adapter, a failed check): roll it back."""


@dataclass(frozen=True)
class EngineState:
    """What the deployer knows of one version on the engine."""

    state: str
    """``ready`` (loaded, checked, recorded for the gateway) or ``failed``."""
    reason: str = ""
    model: str = ""
    """The engine's model name for the version (ready only)."""

    def to_text(self) -> str:
        return json.dumps({"state": self.state, "reason": self.reason, "model": self.model})

    @classmethod
    def from_text(cls, raw: str | bytes | None) -> EngineState | None:
        if raw is None:
            return None
        try:
            data = json.loads(raw)
            return cls(str(data["state"]), str(data.get("reason", "")), str(data.get("model", "")))
        except (ValueError, KeyError, TypeError):
            return None


class EnginePort(Protocol):
    """The inference engine as the deployer drives it."""

    def ensure_loaded(self, version: str) -> EngineState:
        """Load, warm up and check ``version`` unless it is already ready and still listed by the
        engine; record and return the outcome. Raises only for transient trouble (engine or
        registry unreachable: the tick retries); a version that cannot be served is returned
        as ``failed`` with the reason."""
        ...

    def unload(self, version: str) -> None:
        """Stop serving ``version``: remove its model-name record, then unload it from the engine."""
        ...

    def states(self) -> dict[str, EngineState]:
        """Every version with a recorded state."""
        ...

    def describe(self) -> dict[str, Any]:
        """What ``rtrl status`` shows: the engine, its model names and each version's state."""
        ...


def engine_model_name(registered_model: str, version: str) -> str:
    """The engine's name for a version's adapter."""
    return f"{registered_model}-v{version}"


def find_adapter(root: Path) -> Path | None:
    """The directory holding ``adapter_config.json`` in a downloaded version, or None."""
    for candidate in (root / ADAPTER_DIR, root):
        if (candidate / "adapter_config.json").is_file():
            return candidate
    return None


def is_base(root: Path) -> bool:
    """Whether a downloaded version is the engine's base model (manifest ``"engine": "base"``)."""
    try:
        manifest = json.loads((root / "policy.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("engine") == "base"


@dataclass(frozen=True)
class Greedy:
    """A version's greedy continuation of the check prompt: at each step the most likely
    token, its log-probability and its margin over the runner-up (nats)."""

    token_ids: list[int]
    logprobs: list[float]
    margins: list[float]


@dataclass(frozen=True)
class Check:
    """``engine_check.json``: what the engine must reproduce for a version."""

    prompt_ids: list[int]
    prompt_logprobs: list[float | None]
    greedy: Greedy | None = None
    """None in files written before greedy checks: the prompt log-probabilities are checked."""


def write_check(root: Path, prompt_ids: Sequence[int], logprobs: Sequence[float | None],
                greedy: Greedy | None = None) -> Path:
    """``engine_check.json``: the fixed prompt's token ids, the version's own log-probabilities
    of them (None for the first token) and its greedy continuation."""
    path = root / CHECK_FILE
    data: dict[str, Any] = {"prompt_token_ids": [int(t) for t in prompt_ids],
                            "prompt_logprobs": [None if x is None else float(x) for x in logprobs]}
    if greedy is not None:
        data["greedy"] = {"token_ids": [int(t) for t in greedy.token_ids],
                          "logprobs": [float(x) for x in greedy.logprobs],
                          "margins": [float(x) for x in greedy.margins]}
    path.write_text(json.dumps(data))
    return path


def read_check(root: Path) -> Check:
    """The fixed prompt and the candidate's own answers to it."""
    path = root / CHECK_FILE
    try:
        data = json.loads(path.read_text())
        ids = [int(t) for t in data["prompt_token_ids"]]
        lps = [None if x is None else float(x) for x in data["prompt_logprobs"]]
        g = data.get("greedy")
        greedy = None if g is None else Greedy([int(t) for t in g["token_ids"]],
                                               [float(x) for x in g["logprobs"]],
                                               [float(x) for x in g["margins"]])
    except FileNotFoundError:
        raise EngineCheckError(f"the version has no {CHECK_FILE}: its own log-probabilities of a "
                               "fixed prompt are needed to check the engine") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise EngineCheckError(f"{CHECK_FILE} is unreadable: {exc}") from None
    if len(ids) < 2 or len(lps) != len(ids):
        raise EngineCheckError(f"{CHECK_FILE} needs >= 2 prompt tokens and one logprob per token")
    if greedy is not None and (not greedy.token_ids
                               or not len(greedy.token_ids) == len(greedy.logprobs) == len(greedy.margins)):
        raise EngineCheckError(f"{CHECK_FILE}: the greedy continuation needs one logprob and margin "
                               "per token")
    return Check(ids, lps, greedy)


def check_request(model: str, check: Check) -> dict[str, Any]:
    """The warm-up request that checks the engine (``/v1/completions``, vLLM's extra fields)."""
    if check.greedy is None:
        return {"model": model, "prompt": check.prompt_ids, "max_tokens": 1, "temperature": 0.0,
                "prompt_logprobs": 0}
    return {"model": model, "prompt": check.prompt_ids, "max_tokens": len(check.greedy.token_ids),
            "temperature": 0.0, "logprobs": 0, "ignore_eos": True, "return_token_ids": True}


def served_problem(check: Check, answer: Any, tolerance: float) -> str | None:
    """Why the engine's answer to :func:`check_request` disagrees with the version's own
    (None: it agrees)."""
    if check.greedy is None:
        served = engine_prompt_logprobs(check.prompt_ids, answer)
        return check_problem(check.prompt_logprobs, served, tolerance)
    tokens, logprobs = engine_greedy(answer)
    return greedy_problem(check.greedy, tokens, logprobs, tolerance)


def engine_greedy(answer: Any) -> tuple[list[int], list[float | None]]:
    """vLLM's completion answer (``return_token_ids``, ``logprobs: 0``) -> its token ids and
    their log-probabilities."""
    try:
        choice = answer["choices"][0]
        tokens = [int(t) for t in choice["token_ids"]]
        values = choice["logprobs"]["token_logprobs"]
    except (KeyError, IndexError, TypeError, ValueError):
        raise EngineCheckError("the engine returned no token ids with log-probabilities") from None
    if not isinstance(values, list) or len(values) != len(tokens):
        raise EngineCheckError("the engine returned a log-probability count unlike its token count")
    return tokens, [float(v) if isinstance(v, int | float) else None for v in values]


def greedy_problem(reference: Greedy, tokens: Sequence[int], logprobs: Sequence[float | None],
                   tolerance: float) -> str | None:
    """Why the engine's greedy answer disagrees with the version's (None: it agrees).

    Token by token the log-probabilities must agree within ``tolerance`` nats. The answers
    may part only where the version's top two tokens were within ``tolerance`` of each other
    (a near tie that rounding can flip); the comparison ends there."""
    if not tokens:
        return "the engine answered no tokens"
    for i, (want, got) in enumerate(zip(reference.token_ids, tokens, strict=False)):
        if got != want:
            if i > 0 and reference.margins[i] <= tolerance:
                return None
            return (f"the engine's greedy token {i + 1} is {got}, the candidate's is {want} (margin "
                    f"{reference.margins[i]:.4f} nats): the engine is not serving this model")
        value = logprobs[i]
        if value is None or not math.isfinite(value):
            return f"the engine gave no finite log-probability for greedy token {i + 1}"
        if abs(value - reference.logprobs[i]) > tolerance:
            return (f"engine log-probabilities differ from the candidate's by "
                    f"{abs(value - reference.logprobs[i]):.4f} nats at greedy token {i + 1} (tolerance "
                    f"{tolerance:g}): the engine is not serving this model")
    if len(tokens) < len(reference.token_ids):
        return f"the engine answered {len(tokens)} of {len(reference.token_ids)} greedy tokens"
    return None


def engine_prompt_logprobs(prompt_ids: Sequence[int], answer: Any) -> list[float | None]:
    """vLLM's ``prompt_logprobs`` answer -> the logprob of each prompt token (None for the first)."""
    try:
        entries = answer["choices"][0]["prompt_logprobs"]
    except (KeyError, IndexError, TypeError):
        raise EngineCheckError("the engine returned no prompt_logprobs") from None
    if not isinstance(entries, list) or len(entries) != len(prompt_ids):
        raise EngineCheckError("the engine's prompt_logprobs do not match the prompt's length")
    out: list[float | None] = []
    for token, entry in zip(prompt_ids, entries, strict=True):
        if entry is None:
            out.append(None)
            continue
        item = entry.get(str(token)) if isinstance(entry, dict) else None
        value = item.get("logprob") if isinstance(item, dict) else item
        out.append(float(value) if isinstance(value, int | float) else None)
    return out


def check_problem(reference: Sequence[float | None], served: Sequence[float | None],
                  tolerance: float) -> str | None:
    """Why the engine's log-probabilities disagree with the candidate's (None: they agree):
    the largest |difference| over tokens both give must be within ``tolerance`` nats."""
    pairs = [(r, s) for r, s in zip(reference, served, strict=True) if r is not None]
    if not pairs:
        return "no reference log-probabilities to compare"
    if any(s is None or not math.isfinite(s) for _, s in pairs):
        return "the engine gave no finite log-probability for some prompt tokens"
    worst = max(abs(float(r) - float(s)) for r, s in pairs if s is not None)
    if worst > tolerance:
        return (f"engine log-probabilities differ from the candidate's by up to {worst:.4f} nats "
                f"(tolerance {tolerance:g}): the engine is not serving this model")
    return None
