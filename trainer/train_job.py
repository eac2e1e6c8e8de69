"""The training step's port, :class:`TrainJob`, and the in-process job beside it.

An increment hands a job the parent checkpoint and its samples (:class:`TrainRequest`) and
gets back the candidate's saved directory (:class:`TrainResult`). Production runs the job on
Ray Train (trainer/adapters/ray_train.py); :class:`LocalTrainJob` runs the same loop in this
process for unit tests and the benchmark's baseline. Both checkpoint under the request's name
and resume from there, so a retried window continues where the killed attempt stopped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from torch.optim import Optimizer

from trainer.loop import LoopConfig, Sample, load_training_state, rl_train, save_training_state
from trainer.policy import TrainablePolicy, load_policy


@dataclass(frozen=True)
class TrainRequest:
    name: str
    """Run name; the same window always gets the same name, so a retry resumes."""
    parent_dir: Path
    samples: list[Sample]
    loop: LoopConfig
    workdir: Path
    probe: list[Sample] = field(default_factory=list)
    """Where a KL band measures the KL to the parent: the gate's held-out records (empty: a
    probe set is split off the samples)."""


@dataclass
class TrainResult:
    policy_dir: Path
    history: list[dict[str, float]]
    resumed_from_step: int = 0
    """Steps already done by an earlier, killed attempt (0: trained from the parent)."""


class TrainJob(Protocol):
    def run(self, request: TrainRequest) -> TrainResult:
        """Train and return the candidate's saved directory; raise on failure."""
        ...


class LocalTrainJob:
    """Runs :func:`trainer.loop.rl_train` in this process, checkpointing under
    ``workdir/<name>/`` and resuming from there. Used by unit tests and the benchmark's
    baseline; production uses the Ray Train job."""

    def run(self, request: TrainRequest) -> TrainResult:
        ckpt = request.workdir / request.name / "checkpoint"
        if (ckpt / "train_state.pt").exists():
            policy, opt_state, start = load_training_state(ckpt)
        else:
            policy, opt_state, start = load_policy(request.parent_dir), None, 0
        parent = load_policy(request.parent_dir)

        def on_step(step: int, _s: dict[str, float], pol: TrainablePolicy, opt: Optimizer) -> None:
            if step % request.loop.checkpoint_interval == 0:
                save_training_state(ckpt, pol, opt, step)

        history = rl_train(policy, parent, request.samples, request.loop, start, opt_state, on_step,
                           probe=request.probe)
        out = request.workdir / request.name / "final"
        policy.save(out)
        return TrainResult(out, history, start)
