"""Policies: what the gateway samples from and what the trainer updates.

A policy maps a prompt (token ids) to a distribution over completions. Everything outside
the trainer talks to it through :class:`Policy`; the trainer also needs the differentiable
batch scoring of :class:`TrainablePolicy`. A saved policy is a plain directory holding
``policy.json`` (``{"kind": ..., "config": {...}}``) next to the weights, so
:func:`load_policy` can rebuild any kind without knowing how it was trained.

The default kind, ``tiny-transformer``, is a small causal transformer in plain torch
(about 1M parameters with the default config) over the vocabulary of ``trainer/tokens.py``.
Sampling keeps a key/value cache, so a 16-token completion costs about 10 ms on one slow CPU core
(call ``torch.set_num_threads(1)`` in a serving process: small matmuls gain nothing from threads).

Log-probabilities returned by ``sample`` are those of the distribution actually sampled
from (i.e. after temperature); they are the behavior log-probabilities the gateway logs.
``score`` always scores at temperature 1, the distribution the trainer optimises;
``batch_logprobs`` and :func:`score_records` score at given temperatures when asked
(trainer/temperature.py), as the train-inference mismatch and the gate do.
"""

from __future__ import annotations

import importlib
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F  # noqa: N812 (the conventional torch alias)
from torch import Tensor, nn

from ingest.contracts.registry import POLICY_MANIFEST
from trainer.temperature import temperature_column, tempered_log_softmax
from trainer.tokens import BOS, EOS, VOCAB_SIZE

MANIFEST = POLICY_MANIFEST
"""The file inside a saved policy directory that names its kind and config."""

KINDS: dict[str, str] = {
    "tiny-transformer": "trainer.policy:TinyTransformer",
    "hf": "trainer.hf_policy:HFPolicy",
    "hf-lora": "trainer.lora_policy:LoRAPolicy",
}
"""Policy kind -> ``module:Class`` whose ``load(directory, config)`` rebuilds it."""


def sampling_generator(
    temperature: float, seed: int | None, generator: torch.Generator | None
) -> torch.Generator | None:
    """Check ``temperature`` and return the generator ``sample`` draws with: the given one,
    else a fresh one seeded with ``seed``, else None (torch's global generator)."""
    if temperature <= 0:
        raise ValueError("temperature must be > 0 (use a small value for near-greedy)")
    if generator is None and seed is not None:
        return torch.Generator().manual_seed(seed)
    return generator


@runtime_checkable
class Policy(Protocol):
    """The serving side of a policy: sample, score, save."""

    def sample(
        self,
        prompt_tokens: Sequence[int],
        max_new_tokens: int,
        temperature: float = 1.0,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        min_new_tokens: int = 0,
    ) -> tuple[list[int], list[float]]:
        """Sample a completion; return its tokens and the per-token log-probabilities of the
        distribution sampled from. Stops after EOS (included) or ``max_new_tokens`` tokens;
        EOS cannot end it before ``min_new_tokens`` tokens (1: never empty), and the
        log-probabilities are those of the distribution without EOS at those positions."""
        ...

    def score(self, prompt_tokens: Sequence[int], completion_tokens: Sequence[int]) -> list[float]:
        """Per-token log-probabilities of ``completion_tokens`` given the prompt (temperature 1)."""
        ...

    def save(self, directory: str | Path) -> Path:
        """Write the policy (manifest + weights) into ``directory``; return it."""
        ...


class TrainablePolicy(Policy, Protocol):
    """What the trainer needs on top of :class:`Policy`."""

    @property
    def module(self) -> nn.Module:
        """The torch module whose parameters the optimiser updates."""
        ...

    def batch_logprobs(
        self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
        temperatures: Sequence[float] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Differentiable per-token log-probabilities, shape [B, T] right-padded, and the
        float mask [B, T] that is 1 on real completion tokens; at temperature 1, or at one
        served temperature per completion (trainer/temperature.py)."""
        ...

    def clone(self) -> TrainablePolicy:
        """An independent copy (the frozen parent for the KL term)."""
        ...


def load_policy(directory: str | Path) -> TrainablePolicy:
    """Rebuild the policy saved in ``directory`` from its manifest."""
    directory = Path(directory)
    manifest_path = directory / MANIFEST
    if not manifest_path.exists():
        raise FileNotFoundError(f"{directory} holds no {MANIFEST}: not a saved rtrl policy")
    manifest = json.loads(manifest_path.read_text())
    kind = manifest.get("kind")
    if kind not in KINDS:
        raise ValueError(f"unknown policy kind {kind!r} in {manifest_path}; known: {sorted(KINDS)}")
    module_name, cls_name = KINDS[kind].split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    policy: TrainablePolicy = cls.load(directory, manifest.get("config", {}))
    return policy


def write_manifest(directory: Path, kind: str, config: dict[str, Any], **extra: Any) -> None:
    """``policy.json``: the kind, its config, and top-level ``extra`` keys (e.g. ``engine``)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MANIFEST).write_text(json.dumps({"kind": kind, "config": config, **extra}, indent=2))


def pad_batch(
    prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], max_len: int | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Right-padded token ids for prompt+completion, plus where each completion starts.

    Returns ``ids`` [B, L], ``attention`` [B, L] (1 on real tokens), ``positions`` [B, T]
    (the index whose logits predict each completion token), ``targets`` [B, T] (the
    completion tokens, right-padded with 0), ``target_mask`` [B, T]. Prompts longer than
    ``max_len - len(completion)`` keep their last tokens; an empty prompt becomes ``[BOS]``.
    """
    rows = []
    for p, c in zip(prompts, completions, strict=True):
        p = list(p) or [BOS]
        if max_len is not None:
            c = list(c)[: max_len - 1]
            p = p[-(max_len - len(c)):]
        rows.append((list(p), list(c)))
    seq_len = max(len(p) + len(c) for p, c in rows)
    t_len = max(1, max(len(c) for _, c in rows))
    ids = torch.zeros(len(rows), seq_len, dtype=torch.long)
    attn = torch.zeros(len(rows), seq_len, dtype=torch.long)
    targets = torch.zeros(len(rows), t_len, dtype=torch.long)
    tmask = torch.zeros(len(rows), t_len)
    starts = torch.zeros(len(rows), dtype=torch.long)
    for i, (p, c) in enumerate(rows):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c, dtype=torch.long)
        attn[i, : len(p) + len(c)] = 1
        targets[i, : len(c)] = torch.tensor(c, dtype=torch.long)
        tmask[i, : len(c)] = 1.0
        starts[i] = len(p)
    return ids, attn, _gather_index(starts, t_len), targets, tmask


def _gather_index(starts: Tensor, t_len: int) -> Tensor:
    """Positions whose logits predict completion token j: start - 1 + j."""
    return starts[:, None] - 1 + torch.arange(t_len)[None, :]


def completion_logprobs(
    logits: Tensor, positions: Tensor, targets: Tensor, tmask: Tensor,
    temperatures: Sequence[float] | None = None,
) -> Tensor:
    """Log-probabilities [B, T] of ``targets`` read at ``positions`` of ``logits`` [B, L, V]
    at one served temperature per row (None: 1); zero where ``tmask`` is 0."""
    temps = temperature_column(temperatures)
    logp = tempered_log_softmax(logits, None if temps is None else temps.to(logits.device))
    pos = positions.clamp(0, logits.shape[1] - 1)
    picked = logp.gather(1, pos[:, :, None].expand(-1, -1, logp.shape[-1]))
    out = picked.gather(2, targets[:, :, None]).squeeze(-1)
    return out * tmask


# ------------------------------------------------------------------ the default policy


@dataclass(frozen=True)
class TinyConfig:
    """Shape of the default policy."""

    vocab_size: int = VOCAB_SIZE
    d_model: int = 192
    """Width of the residual stream."""
    n_layers: int = 2
    """Few, wide layers: per-token sampling cost on a CPU is dominated by per-layer overhead."""
    n_heads: int = 4
    d_ff: int = 768
    """Hidden width of each feed-forward block."""
    max_len: int = 256
    """Longest prompt + completion; longer prompts keep their last tokens."""
    dropout: float = 0.0


class _Block(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.ff = nn.Sequential(
            nn.Linear(cfg.d_model, cfg.d_ff), nn.GELU(approximate="tanh"), nn.Linear(cfg.d_ff, cfg.d_model)
        )
        self.dropout = cfg.dropout

    def forward(
        self, x: Tensor, cache: tuple[Tensor, Tensor] | None = None, causal: bool = True
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        b, n, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (t.view(b, n, self.n_heads, d // self.n_heads).transpose(1, 2) for t in (q, k, v))
        if cache is not None:
            k = torch.cat([cache[0], k], dim=2)
            v = torch.cat([cache[1], v], dim=2)
        att = F.scaled_dot_product_attention(
            q, k, v, is_causal=causal and n > 1,
            dropout_p=self.dropout if self.training else 0.0,
        )
        x = x + self.proj(att.transpose(1, 2).reshape(b, n, d))
        x = x + self.ff(self.ln2(x))
        return x, (k, v)


class TinyTransformer(nn.Module):
    """The default policy: a pre-norm causal transformer with learned positions."""

    kind = "tiny-transformer"

    def __init__(self, config: TinyConfig | None = None) -> None:
        super().__init__()
        self.config = config or TinyConfig()
        cfg = self.config
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_len, cfg.d_model)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear | nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    # -------------------------------------------------------------- torch side
    def forward(self, ids: Tensor) -> Tensor:
        """Logits [B, L, V] for right-padded ids [B, L] (padding never affects real positions)."""
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))[None]
        for block in self.blocks:
            x, _ = block(x)
        logits: Tensor = self.head(self.ln_f(x))
        return logits

    @property
    def module(self) -> nn.Module:
        return self

    def batch_logprobs(
        self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
        temperatures: Sequence[float] | None = None,
    ) -> tuple[Tensor, Tensor]:
        ids, _attn, positions, targets, tmask = pad_batch(prompts, completions, self.config.max_len)
        dev = self.head.weight.device
        logits = self(ids.to(dev))
        lp = completion_logprobs(logits, positions.to(dev), targets.to(dev), tmask.to(dev), temperatures)
        return lp, tmask.to(dev)

    def clone(self) -> TinyTransformer:
        twin = TinyTransformer(self.config)
        twin.load_state_dict(self.state_dict())
        return twin

    # -------------------------------------------------------------- serving side
    @torch.inference_mode()
    def sample(
        self,
        prompt_tokens: Sequence[int],
        max_new_tokens: int,
        temperature: float = 1.0,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        min_new_tokens: int = 0,
    ) -> tuple[list[int], list[float]]:
        generator = sampling_generator(temperature, seed, generator)
        was_training = self.training
        self.eval()
        try:
            return self._sample(list(prompt_tokens) or [BOS], max_new_tokens, temperature, generator,
                                min_new_tokens)
        finally:
            self.train(was_training)

    def _sample(
        self, prompt: list[int], max_new: int, temperature: float, gen: torch.Generator | None,
        min_new: int = 0,
    ) -> tuple[list[int], list[float]]:
        max_new = max(0, min(max_new, self.config.max_len - 1))
        prompt = prompt[-(self.config.max_len - max_new):]
        out: list[int] = []
        logps: list[float] = []
        if max_new == 0:
            return out, logps
        x = torch.tensor([prompt], dtype=torch.long)
        pos = 0
        caches: list[tuple[Tensor, Tensor] | None] = [None] * len(self.blocks)
        while True:
            h = self.tok(x) + self.pos(torch.arange(pos, pos + x.shape[1]))[None]
            for i, block in enumerate(self.blocks):
                h, caches[i] = block(h, caches[i])
            logits = self.head(self.ln_f(h[:, -1]))[0].float() / temperature
            if len(out) < min_new:
                logits[EOS] = float("-inf")
            logp = torch.log_softmax(logits, dim=-1)
            token = int(torch.multinomial(logp.exp(), 1, generator=gen))
            out.append(token)
            logps.append(float(logp[token]))
            if token == EOS or len(out) >= max_new:
                return out, logps
            pos += x.shape[1]
            x = torch.tensor([[token]], dtype=torch.long)

    @torch.inference_mode()
    def score(self, prompt_tokens: Sequence[int], completion_tokens: Sequence[int]) -> list[float]:
        if not completion_tokens:
            return []
        was_training = self.training
        self.eval()
        try:
            lp, _ = self.batch_logprobs([prompt_tokens], [completion_tokens])
        finally:
            self.train(was_training)
        return [float(v) for v in lp[0, : len(completion_tokens)]]

    def save(self, directory: str | Path) -> Path:
        directory = Path(directory)
        write_manifest(directory, self.kind, asdict(self.config))
        torch.save(self.state_dict(), directory / "model.pt")
        return directory

    @classmethod
    def load(cls, directory: str | Path, config: dict[str, Any]) -> TinyTransformer:
        model = cls(TinyConfig(**config))
        state = torch.load(Path(directory) / "model.pt", map_location="cpu", weights_only=True)
        model.load_state_dict(state)
        model.eval()
        return model


def n_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def n_trainable(module: nn.Module) -> int:
    """Parameters the optimiser updates (a LoRA policy: the adapter's only)."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


@torch.no_grad()
def score_records(policy: TrainablePolicy, prompts: Sequence[Sequence[int]],
                  completions: Sequence[Sequence[int]], batch: int = 64,
                  temperatures: Sequence[float] | None = None) -> list[list[float]]:
    """Each completion's per-token log-probabilities under ``policy`` (in eval mode), scored in
    batches of ``batch``, at the temperature each was served with (None: all at 1)."""
    policy.module.eval()
    out: list[list[float]] = []
    for i in range(0, len(completions), batch):
        chunk = completions[i : i + batch]
        temps = None if temperatures is None else temperatures[i : i + batch]
        lp, _ = policy.batch_logprobs(prompts[i : i + batch], chunk, temps)
        out.extend(lp[j, : len(c)].tolist() for j, c in enumerate(chunk))
    return out


def sequence_logprob(logprobs: Sequence[float]) -> float:
    """Sum of per-token log-probabilities (the completion's log-probability)."""
    return math.fsum(logprobs)
