"""Deliberately bad candidates for the demo (and the end-to-end test) to roll back.

- ``reward-hacked``: the champion fine-tuned to answer every prompt with a clarifying
  question (``[ASK, EOS]``). It dodges rejections and reverts and is fast, the hack Cursor
  met; the edit-rate drift detector and the judge's reward and persistence metrics should
  roll it back.
- ``corrupted``: the champion with Gaussian noise added to every weight (a broken export).
- ``stalling`` and ``malformed-tool`` (``rtrl demo --agent``): an agent fine-tuned to answer
  every turn of a session with a clarifying question, and one that calls the plan's next tool
  without its required arguments (every call a ``schema_mismatch``). The users abandon both
  agents' sessions; the judge's per-session metrics (completion, invalid tool calls) and the
  edit-rate drift detector (for the questions) should roll them back.

Both come from the champion's saved policy directory and are written as a new policy
directory the registry can store like any increment. For a LoRA champion (``rtrl demo
--engine vllm``) the reward-hacked adapter is trained on the world's prompts as chat
(services/demo/chat_model.py) to answer with the question word, and the corrupted one is an
adapter whose weights file is cut short (a broken upload): the engine cannot load it, so the
deployer must roll it back before it serves anyone.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import torch

from ingest.contracts.registry import ADAPTER_DIR
from services.demo.chat_model import chat_pairs
from services.sim.agent import OBSERVATIONS, AgentWorld
from services.sim.users import World, draw_task, make_prompt, question_completion
from services.stack.tiny_llm import truncate_weights
from trainer.policy import TrainablePolicy, load_policy
from trainer.tokens import EOS

Encode = Callable[[list[tuple[list[int], list[int]]]], list[tuple[list[int], list[int]]]]
"""World pairs -> the policy's token ids."""

AGENT_KINDS = ("malformed-tool", "stalling")
"""The agent's bad candidates (``rtrl demo --agent``)."""
KINDS = ("reward-hacked", "corrupted", *AGENT_KINDS)


def make_reward_hacked(champion_dir: Path, out_dir: Path, world: World, seed: int = 0,
                       steps: int = 40, lr: float = 3e-3) -> Path:
    """Supervised steps that teach the champion to ask instead of editing."""
    return _fine_tune(champion_dir, out_dir, world, seed, steps, lr,
                      lambda rng: (make_prompt(draw_task(world, rng), world, rng), question_completion()))


def make_stalling(champion_dir: Path, out_dir: Path, aw: AgentWorld, seed: int = 0, steps: int = 40,
                  lr: float = 3e-3) -> Path:
    """An agent that answers every turn of a session with a clarifying question: it never
    breaks a tool nor has an answer rejected, and it never gets anything done."""
    return _fine_tune(champion_dir, out_dir, aw.world, seed, steps, lr,
                      lambda rng: (_agent_prompt(aw, rng), question_completion()))


def make_malformed_tool(champion_dir: Path, out_dir: Path, aw: AgentWorld, seed: int = 0, steps: int = 40,
                        lr: float = 3e-3) -> Path:
    """An agent that calls the right tool without its required arguments (a broken tool-call
    format after a bad update): every call is a ``schema_mismatch``."""
    def pair(rng: random.Random) -> tuple[list[int], list[int]]:
        task = rng.choice(aw.tasks)
        progress = rng.randrange(len(task.plan) + 1)
        prompt = aw.prompt(task, progress, rng.choice(OBSERVATIONS), rng)
        return prompt, [aw.tools[task.plan[min(progress, len(task.plan) - 1)]], EOS]

    return _fine_tune(champion_dir, out_dir, aw.world, seed, steps, lr, pair)


def _agent_prompt(aw: AgentWorld, rng: random.Random) -> list[int]:
    task = rng.choice(aw.tasks)
    return aw.prompt(task, rng.randrange(len(task.plan) + 1), rng.choice(OBSERVATIONS), rng)


def _fine_tune(champion_dir: Path, out_dir: Path, world: World, seed: int, steps: int, lr: float,
               draw: Callable[[random.Random], tuple[list[int], list[int]]]) -> Path:
    """``steps`` supervised steps of 16 pairs from ``draw`` on the champion, saved to ``out_dir``."""
    torch.set_num_threads(1)  # the demo's services need the other cores
    policy = load_policy(champion_dir)
    encode = _encoder(policy, world)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    module = policy.module
    module.train()
    opt = torch.optim.Adam([p for p in module.parameters() if p.requires_grad], lr=lr)
    for _ in range(steps):
        pairs = encode([draw(rng) for _ in range(16)])
        prompts = [p for p, _ in pairs]
        logp, mask = policy.batch_logprobs(prompts, [c for _, c in pairs])
        loss = -(logp * mask).sum() / len(prompts)
        opt.zero_grad()
        loss.backward()
        opt.step()
    module.eval()
    return policy.save(out_dir)


def _encoder(policy: TrainablePolicy, world: World) -> Encode:
    """How world pairs become ``policy``'s ids: as they are for the built-in policy; as chat
    for a LoRA policy, with its base model's tokenizer."""
    base = getattr(policy, "base_dir", None)
    if base is None:
        return lambda pairs: pairs
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(base))
    return lambda pairs: chat_pairs(tokenizer, world, pairs)


def make_corrupted(champion_dir: Path, out_dir: Path, seed: int = 0, noise: float = 0.5) -> Path:
    """The champion with N(0, noise^2) added to every trainable parameter; for a LoRA adapter,
    then its weights file cut to 16 bytes (the engine cannot load it)."""
    policy = load_policy(champion_dir)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.module.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=gen) * noise)
    policy.module.eval()
    out = policy.save(out_dir)
    if getattr(policy, "base_dir", None) is not None:
        truncate_weights(out / ADAPTER_DIR)
    return out


def make_bad_candidate(kind: str, champion_dir: Path, out_dir: Path, world: World | AgentWorld,
                       seed: int = 0) -> Path:
    if kind == "corrupted":
        return make_corrupted(champion_dir, out_dir, seed)
    if kind in AGENT_KINDS:
        if not isinstance(world, AgentWorld):
            raise ValueError(f"the {kind} candidate is an agent's: it needs the agent world "
                             "(rtrl demo --agent)")
        make = make_stalling if kind == "stalling" else make_malformed_tool
        return make(champion_dir, out_dir, world, seed)
    if kind == "reward-hacked":
        if isinstance(world, AgentWorld):
            raise ValueError("the reward-hacked candidate asks one-shot users: under --agent use stalling")
        return make_reward_hacked(champion_dir, out_dir, world, seed)
    raise ValueError(f"unknown bad candidate kind {kind!r}; choose one of {KINDS}")
