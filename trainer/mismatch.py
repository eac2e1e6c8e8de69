"""The train-inference mismatch: how far the trainer's log-probabilities of the served tokens are
from the ones the inference engine served them with.

The behaviour log-probabilities in the events come from the engine (vLLM in production), whose
kernels and precision differ from the trainer's. Importance weights ``exp(log π_trainer −
log π_engine)`` absorb a small difference; a large one means the trainer is not training the
model the engine serves (another base, another tokenizer, a wrong chat template), and every
weight is then noise. Each increment measures it for its parent on the records the parent
served, before its first step; the gate blocks the candidate when the mean exceeds a bound.

Both sides are the distribution the token was sampled from: the engine logs it after
temperature, and the trainer scores each record at its event's ``temperature``
(trainer/temperature.py; an event without one was sampled at 1).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

from ingest.events import RewardRecord
from trainer.policy import TrainablePolicy, score_records

log = logging.getLogger("trainer.increment")  # the increment's logger: one place to read it


@dataclass(frozen=True)
class Mismatch:
    tokens: int
    """Tokens compared (0: nothing the parent served was in the window)."""
    mean_abs: float
    """Mean of |log π_trainer − log π_engine| over tokens (nats)."""
    p99_abs: float
    """Its 99th percentile (nearest rank)."""
    truncated_share: float
    """Share of tokens whose weight ``exp(trainer − engine)`` exceeds the truncation cap."""

    def figures(self) -> dict[str, float]:
        return {"mismatch_tokens": float(self.tokens), "mismatch_mean_abs": self.mean_abs,
                "mismatch_p99_abs": self.p99_abs, "mismatch_truncated_share": self.truncated_share}


def mismatch(trainer: Sequence[Sequence[float]], engine: Sequence[Sequence[float]],
             truncate: float) -> Mismatch:
    """The mismatch over completions given per token by the trainer and by the engine (pairs of
    equal length). A non-finite difference counts as infinitely far."""
    diffs: list[float] = []
    for t_row, e_row in zip(trainer, engine, strict=True):
        if len(t_row) != len(e_row):
            raise ValueError(f"a completion has {len(t_row)} trainer and {len(e_row)} engine "
                             "log-probabilities")
        diffs.extend(t - e if math.isfinite(t - e) else math.inf for t, e in zip(t_row, e_row, strict=True))
    if not diffs:
        return Mismatch(0, 0.0, 0.0, 0.0)
    absolute = sorted(abs(d) for d in diffs)
    rank = max(1, math.ceil(0.99 * len(absolute)))
    log_cap = math.log(truncate)
    return Mismatch(len(diffs), math.fsum(absolute) / len(absolute), absolute[rank - 1],
                    sum(d > log_cap for d in diffs) / len(diffs))


def measure_parent(parent: TrainablePolicy, records: Sequence[RewardRecord], version: str,
                   truncate: float, limit: int = 256, batch: int = 32) -> Mismatch:
    """The parent's mismatch on (at most ``limit`` of) the records it served itself: those
    served by other versions were sampled from other weights and say nothing about the engine."""
    mine = [r for r in records if r.model.version == version and r.completion_tokens][:limit]
    prompts, completions = [r.prompt_tokens for r in mine], [r.completion_tokens for r in mine]
    trainer = score_records(parent, prompts, completions, batch, [r.temperature for r in mine])
    found = mismatch(trainer, [list(r.behavior_logprobs) for r in mine], truncate)
    log.info("train-inference mismatch of version %s on %d served tokens: mean %.4g, p99 %.4g nats, "
             "%.1f%% of weights truncated", version, found.tokens, found.mean_abs, found.p99_abs,
             100 * found.truncated_share)
    return found
