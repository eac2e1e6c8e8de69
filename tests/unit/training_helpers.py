"""A training run killed at a step and resumed from its checkpoint, for the resume tests of
every policy kind."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from trainer.loop import LoopConfig, Sample, load_training_state, rl_train, save_training_state
from trainer.policy import TrainablePolicy


def killed_and_resumed(start: TrainablePolicy, samples: Sequence[Sample], cfg: LoopConfig, at: int,
                       ckpt: Path) -> tuple[TrainablePolicy, TrainablePolicy, list[dict[str, float]]]:
    """``(uninterrupted, resumed, resumed history)``: the same training from ``start`` once
    straight through, and once checkpointed and "killed" after step ``at``, then resumed from
    that checkpoint."""
    full = start.clone()
    rl_train(full, start.clone(), samples, cfg)
    part = start.clone()

    def kill(step: int, _s: dict[str, float], pol: object, opt: torch.optim.Optimizer) -> None:
        if step == at:
            save_training_state(ckpt, part, opt, step)
            raise KeyboardInterrupt  # "killed"

    with pytest.raises(KeyboardInterrupt):
        rl_train(part, start.clone(), samples, cfg, on_step=kill)
    resumed, opt_state, step = load_training_state(ckpt)
    assert step == at
    history = rl_train(resumed, start.clone(), samples, cfg, start_step=step, optimizer_state=opt_state)
    return full, resumed, history
