"""The training loops, plain torch: the RL increment and the supervised bootstrap.

The same :func:`rl_train` runs inside the Ray Train worker (``trainer/adapters/ray_train.py``)
and directly in-process (``bench/trainer.py`` compares the two). It reads top to bottom:
fixed batch plan from the seed, parent log-probabilities, the objective, Adam on all
parameters, gradient clipping, and a callback after every step that the caller uses for
progress logs and checkpoints. A resumed run skips the steps it already took.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainer.objective import ObjectiveConfig, grpo_loss, next_token_loss, padded
from trainer.objective import Sample as Sample  # re-exported: callers import it here
from trainer.policy import TrainablePolicy, load_policy
from trainer.trust_region import KLBand, Steady, lr_at, split_probe


@dataclass(frozen=True)
class LoopConfig:
    batch_size: int = 32
    epochs: int = 1
    lr: float = 3e-4
    max_grad_norm: float = 1.0
    seed: int = 0
    checkpoint_every: int = 50
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    warmup_steps: int = 0
    """Linear learning-rate warm-up over this many optimiser steps (0: none)."""
    band: KLBand | None = None
    """Aim at a KL to the parent inside this band (trainer/trust_region.py): training stops at
    its target and backs off from overshoots, over up to ``band.max_epochs`` passes. None:
    ``epochs`` passes, whatever the KL."""

    @property
    def passes(self) -> int:
        return self.band.max_epochs if self.band is not None else self.epochs

    @property
    def checkpoint_interval(self) -> int:
        """Steps between checkpoints: ``checkpoint_every``, with a band rounded up to whole probe
        intervals, so that a checkpoint always holds a state the band probed and kept (a resumed
        increment never starts past the band's edge or its length guard)."""
        if self.band is None:
            return self.checkpoint_every
        every = self.band.probe_every
        return -(-self.checkpoint_every // every) * every


StepCallback = Callable[[int, dict[str, float], TrainablePolicy, torch.optim.Optimizer], None]
"""Called after each step with (steps done so far, stats, policy, optimizer)."""


def plan_batches(n: int, batch_size: int, epochs: int, seed: int) -> list[list[int]]:
    """Indices of every batch of every epoch; the same for the same arguments (so a resumed
    run skips exactly the batches it already trained on)."""
    rng = random.Random(seed)
    batches = []
    for _ in range(epochs):
        order = list(range(n))
        rng.shuffle(order)
        batches += [order[i : i + batch_size] for i in range(0, n, batch_size)]
    return batches


def make_optimizer(policy: TrainablePolicy, lr: float) -> torch.optim.Optimizer:
    """Adam over the trainable parameters (a LoRA policy's base stays frozen)."""
    return torch.optim.Adam([p for p in policy.module.parameters() if p.requires_grad], lr=lr)


def rl_train(
    policy: TrainablePolicy,
    parent: TrainablePolicy,
    samples: Sequence[Sample],
    cfg: LoopConfig,
    start_step: int = 0,
    optimizer_state: dict[str, Any] | None = None,
    on_step: StepCallback | None = None,
    shard: tuple[int, int] = (0, 1),
    after_backward: Callable[[TrainablePolicy], None] | None = None,
    probe: Sequence[Sample] = (),
) -> list[dict[str, float]]:
    """Train ``policy`` on ``samples`` against the frozen ``parent``; return per-step stats.

    With several data-parallel workers, worker ``rank`` of ``world`` (``shard``) trains on
    ``batch[rank::world]`` of every batch and ``after_backward`` averages the gradients.
    With a KL band, ``probe`` is the set its KL is measured on (the offline gate's held-out
    records, so the band aims at the KL the gate will measure); without one, a probe set is
    split off ``samples`` by the seed."""
    torch.manual_seed(cfg.seed + start_step)
    optimizer = make_optimizer(policy, cfg.lr)
    if optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)
    parent.module.eval()
    policy.module.train()
    history: list[dict[str, float]] = []
    steady = None
    if cfg.band is not None and samples:
        if not probe:
            train_idx, probe_idx = split_probe(len(samples), cfg.band.probe_size, cfg.seed)
            probe = [samples[i] for i in probe_idx]
            samples = [samples[i] for i in train_idx]
        steady = Steady(cfg.band, parent, list(probe)[: cfg.band.probe_size], cfg.objective.truncate_is)
        if not steady.start(start_step, policy, optimizer):
            return history  # a resumed run that had already reached its target
    batches = plan_batches(len(samples), cfg.batch_size, cfg.passes, cfg.seed)
    for step, idx in enumerate(batches[start_step:], start=start_step + 1):
        t0 = time.perf_counter()
        batch = [samples[i] for i in idx[shard[0] :: shard[1]]] or [samples[idx[0]]]
        prompts = [s.prompt for s in batch]
        completions = [s.completion for s in batch]
        logp, mask = policy.batch_logprobs(prompts, completions)
        with torch.no_grad():
            parent_logp, _ = parent.batch_logprobs(prompts, completions)
        behavior = padded([s.behavior_logprobs for s in batch], mask)
        adv = torch.tensor([s.advantage for s in batch], device=logp.device)
        loss, stats = grpo_loss(logp, parent_logp, behavior, mask, adv, cfg.objective)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
        if after_backward is not None:
            after_backward(policy)
        grad_norm = torch.nn.utils.clip_grad_norm_(policy.module.parameters(), cfg.max_grad_norm)
        lr = lr_at(step, cfg.lr, cfg.warmup_steps, steady.backoffs if steady else 0)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        stats["lr"] = lr
        stats["grad_norm"] = float(grad_norm)
        stats["seq_tokens"] = float(sum(len(p) + len(c) for p, c in zip(prompts, completions, strict=True)))
        stats["step_seconds"] = time.perf_counter() - t0
        stats["step"] = float(step)
        stats["total_steps"] = float(len(batches))
        done = steady is not None and steady.after_step(step, step == len(batches), policy, optimizer, stats)
        history.append(stats)
        if on_step is not None:
            on_step(step, stats, policy, optimizer)
        stats["t_end"] = time.time()  # after the callback: checkpoints count in wall-clock rates
        if done:
            break
    return history


def summarize(history: Sequence[dict[str, float]]) -> dict[str, float]:
    """Per-increment statistics from :func:`rl_train`'s history: means over steps, plus the last
    loss and token counts."""
    if not history:
        return {}
    keys = ["loss", "pg_loss", "kl", "kl_per_token", "clip_fraction", "ess", "truncated_fraction",
            "ratio_mean", "behavior_ratio_mean", "grad_norm"]
    out = {k: math.fsum(h[k] for h in history) / len(history) for k in keys if k in history[0]}
    out["ratio_max"] = max(h.get("ratio_max", 1.0) for h in history)
    out["behavior_ratio_max"] = max(h.get("behavior_ratio_max", 1.0) for h in history)
    out["final_loss"] = history[-1]["loss"]
    out["steps"] = float(len(history))
    out["tokens"] = math.fsum(h.get("seq_tokens", 0.0) for h in history)
    steps_s = math.fsum(h.get("step_seconds", 0.0) for h in history)
    out["steps_seconds"] = steps_s
    out["tokens_per_s"] = out["tokens"] / steps_s if steps_s > 0 else 0.0
    last = history[-1]
    if "band_stop" in last:  # the KL band's outcome (trainer/trust_region.py)
        out.update(band_probe_kl=last["probe_kl_kept"], band_backoffs=last["backoffs"],
                   band_stop=last["band_stop"], lr_final=last["lr"])
        if "probe_length_change_kept" in last:
            out["band_length_change"] = last["probe_length_change_kept"]
    return out


def sft_train(
    policy: TrainablePolicy,
    pairs: Sequence[tuple[list[int], list[int]]],
    cfg: LoopConfig,
    on_step: StepCallback | None = None,
) -> list[dict[str, float]]:
    """Supervised next-token training on the completions given their prompts (bootstrap)."""
    torch.manual_seed(cfg.seed)
    optimizer = make_optimizer(policy, cfg.lr)
    policy.module.train()
    history: list[dict[str, float]] = []
    batches = plan_batches(len(pairs), cfg.batch_size, cfg.epochs, cfg.seed)
    for step, idx in enumerate(batches, start=1):
        t0 = time.perf_counter()
        logp, mask = policy.batch_logprobs([pairs[i][0] for i in idx], [pairs[i][1] for i in idx])
        loss = next_token_loss(logp, mask)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
        torch.nn.utils.clip_grad_norm_(policy.module.parameters(), cfg.max_grad_norm)
        optimizer.step()
        stats = {"loss": float(loss.detach()), "tokens": float(mask.sum()), "step": float(step),
                 "total_steps": float(len(batches)), "step_seconds": time.perf_counter() - t0}
        history.append(stats)
        if on_step is not None:
            on_step(step, stats, policy, optimizer)
    policy.module.eval()
    return history


# ------------------------------------------------------------------ checkpoints

STATE_FILE = "train_state.pt"


def save_training_state(
    directory: Path, policy: TrainablePolicy, optimizer: torch.optim.Optimizer, step: int
) -> Path:
    """A checkpoint: the policy (loadable on its own) plus optimizer state and step."""
    policy.save(directory / "policy")
    torch.save({"optimizer": optimizer.state_dict(), "step": step}, directory / STATE_FILE)
    return directory


def load_training_state(directory: Path) -> tuple[TrainablePolicy, dict[str, Any], int]:
    state = torch.load(directory / STATE_FILE, map_location="cpu", weights_only=False)
    return load_policy(directory / "policy"), state["optimizer"], int(state["step"])

