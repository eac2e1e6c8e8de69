"""``rtrl bench trl``: rtrl's policy-update step against TRL's GRPO loss step, on the same LoRA
model, LoRA config, batches and optimiser.

Why not TRL end to end: ``GRPOTrainer`` generates the completions it trains on. Every step its
``_prepare_inputs`` calls ``_generate_and_score_completions``, which samples from the current
policy and scores the samples with the reward functions; no configuration feeds it completions
that were already served, their rewards and the behaviour log-probabilities the engine logged,
which is all an rtrl increment has. So the benchmark times the step both do once a batch of
logged completions is in hand, TRL's with TRL's own code:

* **rtrl**: :func:`trainer.loop.rl_train`, one pass over the batches (in-step time: padding,
  the policy's forward with gradient, the parent's forward, the loss, backward, gradient
  clipping and Adam).
* **TRL**: per batch, the tensors TRL's loss takes; the parent's log-probabilities with TRL's
  ``_get_per_token_logps_and_entropies`` (no gradient); ``GRPOTrainer._compute_loss`` with
  ``loss_type="dr_grpo"``, ``beta`` = rtrl's KL weight, ``epsilon``/``epsilon_high`` = rtrl's
  clip range and the truncated behaviour weight as ``importance_sampling_ratio`` (TRL applies
  that weight only when it generated with vLLM, so the trainer's two flags are set for it);
  backward, the same clipping and the same Adam.

Both run with one torch thread, alternating, ``--rounds`` times; the figure is the median
in-step time per batch. Before timing, the first batch's loss is computed both ways from the
same weights: TRL's ``dr_grpo`` divides the summed token loss by ``batch × max_completion_length``
where rtrl divides by the batch, so ``rtrl = TRL × max_completion_length`` when both compute the
same objective (the behaviour log-probabilities are the policy's own, so every weight is 1 and
the KL weighting conventions agree). TRL is an optional extra: ``pip install 'rtrl[trl]'``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.trainer import LORA, bench_policy, describe, make_samples
from trainer.loop import LoopConfig, Sample, plan_batches, rl_train
from trainer.lora_policy import LoRAPolicy
from trainer.objective import ObjectiveConfig


def grpo_trainer(model: Any, tokenizer: Any, objective: ObjectiveConfig, batch_size: int,
                 max_completion: int, workdir: Path) -> Any:
    """A TRL ``GRPOTrainer`` around ``model`` configured as rtrl's objective (never trained:
    only its loss is called)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(workdir / "trl"), loss_type="dr_grpo", beta=objective.kl_coef,
        epsilon=objective.clip_low, epsilon_high=objective.clip_high, max_completion_length=max_completion,
        per_device_train_batch_size=batch_size, num_generations=batch_size, use_vllm=False,
        report_to=[], use_cpu=True, logging_steps=1_000_000, save_strategy="no", bf16=False,
    )
    trainer: Any = GRPOTrainer(model=model, reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
                               args=args, train_dataset=Dataset.from_list([{"prompt": "x"}] * batch_size),
                               processing_class=tokenizer)
    trainer.use_vllm = True  # only so that _compute_loss applies importance_sampling_ratio
    trainer.vllm_importance_sampling_correction = True
    trainer.current_gradient_accumulation_steps = 1  # what Trainer's loop sets before each step
    trainer.model.train()
    return trainer


def trl_copy(start: LoRAPolicy, parent: bool = False) -> Any:
    """A copy of the policy's PEFT model with the fused LM head TRL's trainer patches into the
    models it trains (log-probabilities and entropies) and into its reference model."""
    from trl.trainer.utils import add_fused_lm_head

    model: Any = copy.deepcopy(start.model)
    add_fused_lm_head(model.get_base_model(), outputs=("log_probs",) if parent else ("log_probs", "entropy"))
    return model


def trl_inputs(batch: list[Sample], pad: int) -> dict[str, torch.Tensor]:
    """TRL's loss inputs: prompts left-padded, completions right-padded (ids and masks), the
    advantages, and the behaviour log-probabilities (right-padded, for the weights)."""
    p_len = max(len(s.prompt) for s in batch)
    c_len = max(len(s.completion) for s in batch)
    prompt_ids = torch.full((len(batch), p_len), pad, dtype=torch.long)
    prompt_mask = torch.zeros((len(batch), p_len), dtype=torch.long)
    completion_ids = torch.full((len(batch), c_len), pad, dtype=torch.long)
    completion_mask = torch.zeros((len(batch), c_len), dtype=torch.long)
    behavior = torch.zeros((len(batch), c_len))
    for i, s in enumerate(batch):
        prompt_ids[i, p_len - len(s.prompt):] = torch.tensor(s.prompt)
        prompt_mask[i, p_len - len(s.prompt):] = 1
        completion_ids[i, : len(s.completion)] = torch.tensor(s.completion)
        completion_mask[i, : len(s.completion)] = 1
        behavior[i, : len(s.completion)] = torch.tensor(s.behavior_logprobs)
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask, "advantages": torch.tensor([s.advantage for s in batch]),
            "behavior": behavior, "num_items_in_batch": completion_mask.sum()}


def trl_loss(trainer: Any, model: Any, parent: Any, batch: list[Sample], pad: int,
             truncate: float) -> torch.Tensor:
    """TRL's dr_grpo loss of one batch, the parent's log-probabilities computed TRL's way."""
    inputs = trl_inputs(batch, pad)
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    with torch.no_grad():
        ref, _, _ = trainer._get_per_token_logps_and_entropies(parent, input_ids, attention,
                                                               inputs["completion_ids"].size(1))
    mask = inputs["completion_mask"]
    weight = torch.exp(ref - inputs.pop("behavior")).clamp(max=truncate) * mask
    inputs.update(old_per_token_logps=ref, ref_per_token_logps=ref, importance_sampling_ratio=weight)
    loss: torch.Tensor = trainer._compute_loss(model, inputs)
    return loss


def time_trl(trainer: Any, model: Any, parent: Any, batches: list[list[Sample]], pad: int,
             loop: LoopConfig) -> list[float]:
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=loop.lr)
    out = []
    for batch in batches:
        t0 = time.perf_counter()
        loss = trl_loss(trainer, model, parent, batch, pad, loop.objective.truncate_is)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, loop.max_grad_norm)
        optimizer.step()
        out.append(time.perf_counter() - t0)
    return out


def time_rtrl(start: LoRAPolicy, samples: list[Sample], loop: LoopConfig) -> list[float]:
    policy, parent = start.clone(), start.clone()
    history = rl_train(policy, parent, samples, loop)
    return [h["step_seconds"] for h in history]


def first_losses(start: LoRAPolicy, trainer: Any, batch: list[Sample], pad: int,
                 loop: LoopConfig) -> tuple[float, float]:
    """The same batch's loss from the same weights: rtrl's, and TRL's × max_completion_length."""
    from trainer.objective import grpo_loss

    policy, parent = start.clone(), start.clone()
    prompts, completions = [s.prompt for s in batch], [s.completion for s in batch]
    logp, mask = policy.batch_logprobs(prompts, completions)
    with torch.no_grad():
        parent_logp, _ = parent.batch_logprobs(prompts, completions)
    behavior = torch.zeros_like(logp)
    for i, s in enumerate(batch):
        behavior[i, : len(s.completion)] = torch.tensor(s.behavior_logprobs)
    adv = torch.tensor([s.advantage for s in batch])
    ours, _ = grpo_loss(logp, parent_logp, behavior, mask, adv, loop.objective)
    theirs = trl_loss(trainer, trl_copy(start), trl_copy(start, parent=True), batch, pad,
                      loop.objective.truncate_is)
    return float(ours.detach()), float(theirs.detach()) * trainer.max_completion_length


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="rtrl bench trl", description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rtrl/TRL passes over the batches")
    ap.add_argument("--warmup", type=int, default=3, help="steps of each pass left out of the median")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        import trl
    except ImportError:
        print("rtrl bench trl needs TRL: pip install 'rtrl[trl]'", flush=True)
        return 2
    os.environ.setdefault("ACCELERATE_USE_CPU", "true")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    loop = LoopConfig(batch_size=args.batch_size, epochs=1, lr=1e-3)
    with tempfile.TemporaryDirectory(prefix="rtrl-bench-trl-") as tmp:
        work = Path(tmp)
        start, base, vocab = bench_policy("lora", work)
        assert isinstance(start, LoRAPolicy) and base is not None
        samples = make_samples(start, args.samples, seed=1, vocab=vocab)
        plan = plan_batches(len(samples), loop.batch_size, 1, loop.seed)
        batches = [[samples[i] for i in idx] for idx in plan]
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(base))
        max_completion = max(len(s.completion) for s in samples)
        trainer = grpo_trainer(copy.deepcopy(start.model), tokenizer, loop.objective, loop.batch_size,
                               max_completion, work)
        pad = int(tokenizer.pad_token_id)
        ours, theirs = first_losses(start, trainer, batches[0], pad, loop)
        rtrl_s: list[float] = []
        trl_s: list[float] = []
        for _ in range(args.rounds):
            rtrl_s += time_rtrl(start, samples, loop)[args.warmup:]
            trl_s += time_trl(trainer, trl_copy(start), trl_copy(start, parent=True), batches, pad,
                              loop)[args.warmup:]
    rtrl_med, trl_med = statistics.median(rtrl_s), statistics.median(trl_s)
    report = {"trl_version": trl.__version__, "policy": describe(start), "lora": LORA.__dict__,
              "batch_size": loop.batch_size, "batches_per_pass": len(batches), "rounds": args.rounds,
              "first_batch_loss": {"rtrl": ours, "trl_x_max_completion_length": theirs},
              "rtrl_step_ms": 1000 * rtrl_med, "trl_step_ms": 1000 * trl_med, "speedup": trl_med / rtrl_med}
    print(f"policy-update step on logged data ({describe(start)}, batch {loop.batch_size}, "
          f"{len(batches)} batches x {args.rounds} rounds, one thread):")
    print(f"  same objective: first batch loss rtrl {ours:.6f}, "
          f"TRL dr_grpo x {max_completion} = {theirs:.6f}")
    print(f"  rtrl (trainer.loop.rl_train)      {1000 * rtrl_med:7.2f} ms/step (median)")
    print(f"  TRL {trl.__version__} (GRPOTrainer._compute_loss) {1000 * trl_med:7.2f} ms/step (median)")
    print(f"  TRL / rtrl time                  {trl_med / rtrl_med:7.2f}x   "
          "(target: rtrl at least as fast, >= 1)")
    if args.json:
        print(json.dumps(report, indent=2))
    return 0
