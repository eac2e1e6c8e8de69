"""The models behind the gateway: one backend per (arm, version), loaded in the background.

A :class:`Backend` turns a prompt into a :class:`Generation`. Two kinds exist: a local
policy loaded from the MLflow registry by version (:class:`PolicyBackend`) and an
OpenAI-compatible upstream endpoint (services/gateway/upstream.py).

:class:`ModelSlots` holds the backend each arm serves. The routing poller tells it which
version each arm *should* serve (``want``); a loader thread loads what is missing
(``step``) and swaps it in only once it is ready, so requests never wait on a load:

* **stable** keeps serving its current version until the new one has loaded (a promotion
  or a fresh champion never leaves a gap); if no stable has ever loaded, there is none
  and the gateway answers 503.
* **canary** is dropped as soon as the wanted version changes or disappears (a rolled-back
  canary must stop serving at once); its users are served by stable until the new
  version is ready. **holdout** (the long-term holdout's pinned version) behaves the same.
* A version that fails to load is retried after ``retry_s``; meanwhile the arm keeps its
  previous backend (stable) or stays empty (canary). Failures are counted by arm.
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from deployer.routing import Arm
from ingest.contracts.prometheus import GATEWAY_ERRORS, GATEWAY_MODEL_LOADS, GATEWAY_SERVING
from services.gateway.generation import BadRequestError, GenRequest, Piece
from services.gateway.local_text import Tokenizer, load_tokenizer, pieces, prompt_ids
from trainer.tokens import EOS

log = logging.getLogger(__name__)

ARMS: tuple[Arm, ...] = ("stable", "canary", "holdout")


@dataclass(frozen=True)
class Generation:
    """What a backend produced for one request."""

    tokens: list[int]
    logprobs: list[float]
    tool_calls: int = 0
    invalid_tool_calls: int = 0


class Backend(Protocol):
    """One loaded model version. ``generate`` may be called from many threads at once and
    raises on failure (the gateway maps the exception to an error response or a fallback)."""

    vocab_size: int | None
    """Token ids must be below this (None: not checked by the gateway)."""

    def generate(self, prompt_tokens: Sequence[int], max_tokens: int, temperature: float) -> Generation: ...

    def stream(self, req: GenRequest, stream: bool = True) -> Iterator[Piece]:
        """The OpenAI API: the generation's pieces (``stream=False``: the backend may produce
        it in one piece). Raises :class:`BadRequestError` for requests this model cannot serve."""
        ...

    def close(self) -> None: ...


class PolicyBackend:
    """A local policy (trainer/policy.py) sampled in-process."""

    def __init__(self, policy: object, vocab_size: int | None = None, min_tokens: int = 0,
                 tokenizer: Tokenizer | None = None) -> None:
        from trainer.policy import Policy

        if not isinstance(policy, Policy):
            raise TypeError(f"{type(policy).__name__} is not a Policy (needs sample/score/save)")
        self.policy = policy
        config = getattr(policy, "config", None)
        self.vocab_size = vocab_size or getattr(config, "vocab_size", None)
        self.min_tokens = min_tokens
        """EOS cannot end a completion before this many tokens (1: never an empty answer)."""
        self.tokenizer = tokenizer

    def stream(self, req: GenRequest, stream: bool = True) -> Iterator[Piece]:
        """Tools are not shown to a local policy and its answers make no tool calls, so a
        request that requires one (``tool_choice`` ``required`` or a named function) is refused."""
        if req.tools and req.tool_choice not in (None, "auto", "none"):
            raise BadRequestError("this model is a local policy and makes no tool calls: send tool_choice "
                                  "'auto' or 'none', or serve it on an engine (docs/serving.md)")
        prompt = prompt_ids(req, self.tokenizer)
        if self.vocab_size is not None and prompt and max(prompt) >= self.vocab_size:
            raise BadRequestError(f"prompt token ids must be below the vocabulary size {self.vocab_size}")
        if req.temperature <= 0.0:
            raise BadRequestError("this model samples only at temperature > 0")
        gen = self.generate(prompt, req.max_tokens, req.temperature)
        eos = set(getattr(self.policy, "eos", ()) or ()) or {EOS}
        ended = len(gen.tokens) < req.max_tokens or bool(gen.tokens and gen.tokens[-1] in eos)
        yield from pieces(req, self.tokenizer, prompt, gen.tokens, gen.logprobs, ended)

    def generate(self, prompt_tokens: Sequence[int], max_tokens: int, temperature: float) -> Generation:
        tokens, logprobs = self.policy.sample(prompt_tokens, max_tokens, temperature,
                                              min_new_tokens=self.min_tokens)
        return Generation(tokens=list(tokens), logprobs=[float(x) for x in logprobs])

    def close(self) -> None:
        return None


class ModelSource(Protocol):
    """Where local policies come from: deployer.registry.Registry (MlflowRegistry in
    production) satisfies it."""

    def alias_version(self, alias: str) -> str | None:
        """The version an alias points at, or None when the alias does not exist."""
        ...

    def download(self, version: str, dst_dir: str | Path) -> Path:
        """Fetch a version's files under ``dst_dir``; return the directory holding the policy."""
        ...


def policy_loader(source: ModelSource, cache_dir: Path | None,
                  min_tokens: int = 0) -> Callable[[Arm, str], Backend]:
    """A loader for ModelSlots: download a version from ``source`` and load its policy
    (served with ``min_tokens``, see :class:`PolicyBackend`)."""
    root = cache_dir or Path(tempfile.mkdtemp(prefix="rtrl-gateway-models-"))

    def load(arm: Arm, version: str) -> Backend:
        from trainer.policy import load_policy

        directory = source.download(version, root / f"v{version}-{time.monotonic_ns()}")
        tokenizer = load_tokenizer(directory)
        return PolicyBackend(load_policy(directory), min_tokens=min_tokens, tokenizer=tokenizer)

    return load


@dataclass
class _Slot:
    wanted: str | None = None
    version: str | None = None
    backend: Backend | None = None


class ModelSlots:
    """The backend serving each arm, kept in step with the wanted versions by ``step``."""

    def __init__(
        self,
        loader: Callable[[Arm, str], Backend],
        retry_s: float = 30.0,
        share_across_arms: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._loader = loader
        self._retry_s = retry_s
        self._share = share_across_arms
        """Local policies: a version loaded for one arm serves the other too (promotion is
        instant). Upstream endpoints are per arm, so nothing is shared."""
        self._clock = clock
        self._slots: dict[Arm, _Slot] = {arm: _Slot() for arm in ARMS}
        self._failed: dict[tuple[Arm, str], float] = {}
        self._loaded: dict[str, Backend] = {}
        """version -> backend of versions installed since the last step (shared mode), so a
        canary dropped by a promotion is still there for stable to pick up."""
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ----------------------------------------------------------------- request path
    def get(self, arm: Arm) -> tuple[str, Backend] | None:
        slot = self._slots[arm]
        version, backend = slot.version, slot.backend
        return (version, backend) if version is not None and backend is not None else None

    def wanted(self, arm: Arm) -> str | None:
        return self._slots[arm].wanted

    # ----------------------------------------------------------------- control path
    def want(self, stable: str | None, canary: str | None, holdout: str | None = None) -> None:
        """Set the versions each arm should serve; loads happen in ``step``."""
        changed = False
        with self._lock:
            wants: tuple[tuple[Arm, str | None], ...] = (("stable", stable), ("canary", canary),
                                                         ("holdout", holdout))
            for arm, version in wants:
                slot = self._slots[arm]
                if slot.wanted != version:
                    changed = True
                    log.info("%s arm: wanted version %s -> %s", arm, slot.wanted, version)
                    slot.wanted = version
                    # stable keeps serving its last version until the new one loads (and
                    # rather than nothing when no version is wanted); the others stop at once.
                    if arm != "stable" and slot.version != version:
                        self._install(arm, None, None)
        if changed:
            self._wake.set()

    def step(self) -> None:
        """Load whatever wanted version is missing (one pass; the loader thread loops it)."""
        for arm in ARMS:
            slot = self._slots[arm]
            version = slot.wanted
            if version is None or slot.version == version:
                continue
            failed_at = self._failed.get((arm, version))
            if failed_at is not None and self._clock() - failed_at < self._retry_s:
                continue
            backend = self._reuse(arm, version)
            if backend is None:
                started = time.perf_counter()
                try:
                    backend = self._loader(arm, version)
                except Exception as exc:
                    self._failed[(arm, version)] = self._clock()
                    GATEWAY_MODEL_LOADS.labels(arm, "failed").inc()
                    GATEWAY_ERRORS.labels(arm, version, "load").inc()
                    log.error("%s arm: version %s failed to load (retry in %.0fs): %s",
                              arm, version, self._retry_s, exc)
                    continue
                GATEWAY_MODEL_LOADS.labels(arm, "loaded").inc()
                log.info("%s arm: version %s loaded in %.2fs", arm, version, time.perf_counter() - started)
            with self._lock:
                if slot.wanted == version:  # still wanted after the (slow) load
                    self._install(arm, version, backend)
                    self._failed.pop((arm, version), None)
        with self._lock:
            installed = {s.version for s in self._slots.values()}
            self._loaded = {v: b for v, b in self._loaded.items() if v in installed}

    def _reuse(self, arm: Arm, version: str) -> Backend | None:
        return self._loaded.get(version) if self._share else None

    def _install(self, arm: Arm, version: str | None, backend: Backend | None) -> None:
        slot = self._slots[arm]
        if slot.version is not None:
            GATEWAY_SERVING.labels(arm, slot.version).set(0)
        slot.version, slot.backend = version, backend
        if version is not None and backend is not None:
            GATEWAY_SERVING.labels(arm, version).set(1)
            self._loaded[version] = backend

    # ----------------------------------------------------------------- thread
    def start(self, idle_s: float = 1.0) -> ModelSlots:
        def run() -> None:
            while not self._stop.is_set():
                try:
                    self.step()
                except Exception:  # never let the loader die: the next pass retries
                    log.exception("model loader pass failed")
                self._wake.wait(idle_s)
                self._wake.clear()

        self._thread = threading.Thread(target=run, name="model-loader", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
