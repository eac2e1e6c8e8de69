"""Deliberately bad candidates for the demo (and the end-to-end test) to roll back.

- ``reward-hacked``: the champion fine-tuned to answer every prompt with a clarifying
  question (``[ASK, EOS]``). It dodges rejections and reverts and is fast, the hack Cursor
  met; the edit-rate drift detector and the judge's reward and persistence metrics should
  roll it back.
- ``corrupted``: the champion with Gaussian noise added to every weight (a broken export).

Both come from the champion's saved policy directory and are written as a new policy
directory the registry can store like any increment.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from services.local.sim_users import World, draw_task, make_prompt, question_completion
from trainer.policy import load_policy

KINDS = ("reward-hacked", "corrupted")


def make_reward_hacked(champion_dir: Path, out_dir: Path, world: World, seed: int = 0,
                       steps: int = 40, lr: float = 3e-3) -> Path:
    """Supervised steps that teach the champion to ask instead of editing."""
    torch.set_num_threads(1)  # the demo's services need the other cores
    policy = load_policy(champion_dir)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    module = policy.module
    module.train()
    opt = torch.optim.Adam(module.parameters(), lr=lr)
    target = question_completion()
    for _ in range(steps):
        prompts = [make_prompt(draw_task(world, rng), world, rng) for _ in range(16)]
        logp, mask = policy.batch_logprobs(prompts, [target] * len(prompts))
        loss = -(logp * mask).sum() / len(prompts)
        opt.zero_grad()
        loss.backward()
        opt.step()
    module.eval()
    return policy.save(out_dir)


def make_corrupted(champion_dir: Path, out_dir: Path, seed: int = 0, noise: float = 0.5) -> Path:
    """The champion with N(0, noise^2) added to every parameter."""
    policy = load_policy(champion_dir)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.module.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * noise)
    policy.module.eval()
    return policy.save(out_dir)


def make_bad_candidate(kind: str, champion_dir: Path, out_dir: Path, world: World, seed: int = 0) -> Path:
    if kind == "reward-hacked":
        return make_reward_hacked(champion_dir, out_dir, world, seed)
    if kind == "corrupted":
        return make_corrupted(champion_dir, out_dir, seed)
    raise ValueError(f"unknown bad candidate kind {kind!r}; choose one of {KINDS}")
