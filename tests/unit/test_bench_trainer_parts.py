"""The trainer benchmarks' pure parts: the whole batch's tokens for a data-parallel history, and
the tensors TRL's loss takes (no TRL needed to build them)."""

from __future__ import annotations

import pytest
import torch

from bench.trainer import whole_batch_tokens
from bench.trl_compare import trl_inputs
from trainer.loop import LoopConfig, Sample, plan_batches

pytestmark = pytest.mark.unit


def samples() -> list[Sample]:
    return [Sample([1] * (2 + i % 3), [5] * (1 + i % 4), [-1.0] * (1 + i % 4), float(i)) for i in range(10)]


def test_whole_batch_tokens_counts_every_workers_share() -> None:
    loop = LoopConfig(batch_size=4, epochs=2, seed=3)
    data = samples()
    batches = plan_batches(len(data), 4, 2, 3)
    history = [{"step": 2.0, "seq_tokens": 1.0, "t_end": 5.0}, {"step": 5.0, "seq_tokens": 1.0, "t_end": 6.0}]
    out = whole_batch_tokens(history, data, loop)
    for h, step in zip(out, (2, 5), strict=True):
        want = sum(len(data[i].prompt) + len(data[i].completion) for i in batches[step - 1])
        assert h["seq_tokens"] == want and h["t_end"] == {2: 5.0, 5: 6.0}[step]


def test_trl_inputs_pad_prompts_left_and_completions_right() -> None:
    batch = [Sample([7, 8, 9], [4], [-0.5], 1.0), Sample([6], [3, 2], [-0.25, -0.75], -1.0)]
    got = trl_inputs(batch, pad=0)
    assert got["prompt_ids"].tolist() == [[7, 8, 9], [0, 0, 6]]
    assert got["prompt_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert got["completion_ids"].tolist() == [[4, 0], [3, 2]]
    assert got["completion_mask"].tolist() == [[1, 0], [1, 1]]
    assert got["behavior"].tolist() == [[-0.5, 0.0], [-0.25, -0.75]]
    assert got["advantages"].tolist() == [1.0, -1.0] and int(got["num_items_in_batch"]) == 3
    assert got["prompt_ids"].dtype == torch.long
