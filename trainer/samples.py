"""An increment's training samples from its reward records (pure): the advantages grouped as
the trainer groups records (trainer/objective.py), and the records as samples."""

from __future__ import annotations

from collections.abc import Sequence

from ingest.events import RewardRecord
from trainer.loop import Sample
from trainer.objective import advantages


def build_samples(records: Sequence[RewardRecord], group_size: int, normalize_std: bool) -> list[Sample]:
    """Samples with group-relative advantages (:func:`record_advantages`)."""
    rewards = [r.reward for r in records]
    return to_samples(records, record_advantages(records, rewards, group_size, normalize_std))


def record_advantages(records: Sequence[RewardRecord], rewards: Sequence[float], group_size: int,
                      normalize_std: bool) -> list[float]:
    """The advantages of ``rewards`` grouped as the trainer groups ``records`` (by prompt; a
    session's turns by session): :func:`trainer.objective.advantages`."""
    sessions = [r.session_id if r.session_credit else None for r in records]
    return advantages(rewards, [tuple(r.prompt_tokens) for r in records], sessions, group_size, normalize_std)


def to_samples(records: Sequence[RewardRecord], advantages: Sequence[float]) -> list[Sample]:
    return [Sample(list(r.prompt_tokens), list(r.completion_tokens), list(r.behavior_logprobs), a,
                   r.temperature) for r, a in zip(records, advantages, strict=True)]
