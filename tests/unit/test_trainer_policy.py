"""The default policy: sampling with a KV cache agrees with full-sequence scoring, save/load
round-trips through the manifest, and padding never leaks into real positions."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from trainer.policy import (
    MANIFEST,
    Policy,
    TinyConfig,
    TinyTransformer,
    load_policy,
    n_parameters,
    pad_batch,
)
from trainer.tokens import BOS, EOS, VOCAB_SIZE

SMALL = TinyConfig(d_model=32, n_layers=2, n_heads=2, d_ff=64, max_len=64)


def test_default_size_is_about_a_million_parameters() -> None:
    n = n_parameters(TinyTransformer())
    assert 0.9e6 <= n <= 3e6
    assert TinyTransformer().config.vocab_size == VOCAB_SIZE


def test_sample_logprobs_match_score() -> None:
    torch.manual_seed(0)
    policy = TinyTransformer(SMALL)
    prompt = [BOS, 5, 6, 7]
    tokens, logps = policy.sample(prompt, 12, seed=3)
    assert 1 <= len(tokens) <= 12
    assert len(logps) == len(tokens)
    assert all(lp <= 0 for lp in logps)
    assert policy.score(prompt, tokens) == pytest.approx(logps, abs=1e-4)


def test_sample_stops_at_eos_and_respects_max_new() -> None:
    policy = TinyTransformer(SMALL)
    with torch.no_grad():  # the final features become a constant vector that only EOS reads
        policy.ln_f.weight.zero_()
        policy.ln_f.bias.zero_()
        policy.ln_f.bias[0] = 1.0
        policy.head.weight.zero_()
        policy.head.weight[EOS, 0] = 50.0
    tokens, logps = policy.sample([BOS, 4], 5, seed=0)
    assert tokens == [EOS]
    assert logps[0] == pytest.approx(0.0, abs=1e-6)
    with torch.no_grad():
        policy.head.weight[EOS, 0] = -50.0  # now EOS never comes: stop at max_new_tokens
    tokens, _ = policy.sample([BOS, 4], 5, seed=0)
    assert len(tokens) == 5 and EOS not in tokens
    assert policy.sample([BOS], 0) == ([], [])


def test_min_new_tokens_keeps_eos_out_and_logs_the_distribution_sampled() -> None:
    policy = TinyTransformer(SMALL)
    with torch.no_grad():  # EOS almost certain at every position, token 9 next most likely
        policy.ln_f.weight.zero_()
        policy.ln_f.bias.zero_()
        policy.ln_f.bias[0] = 1.0
        policy.head.weight.zero_()
        policy.head.weight[EOS, 0] = 50.0
        policy.head.weight[9, 0] = 5.0
    tokens, logps = policy.sample([BOS, 4], 5, seed=0, min_new_tokens=2)
    assert tokens == [9, 9, EOS]
    # without EOS the first two positions are a softmax over the rest: 9 at e^5 against
    # the other VOCAB_SIZE - 2 tokens at e^0
    expected = 5.0 - math.log(math.exp(5.0) + VOCAB_SIZE - 2)
    assert logps[:2] == pytest.approx([expected, expected], abs=1e-5)
    assert logps[2] == pytest.approx(0.0, abs=1e-6)
    assert policy.sample([BOS, 4], 5, seed=0, min_new_tokens=0)[0] == [EOS]


def test_uniform_logits_give_log_vocab() -> None:
    policy = TinyTransformer(SMALL)
    with torch.no_grad():
        policy.head.weight.zero_()
    _, logps = policy.sample([BOS, 3], 4, seed=1)
    assert logps == pytest.approx([-math.log(VOCAB_SIZE)] * len(logps), abs=1e-5)


def test_seed_makes_sampling_reproducible_and_temperature_changes_logprobs() -> None:
    policy = TinyTransformer(SMALL)
    a = policy.sample([BOS, 9], 8, seed=11)
    b = policy.sample([BOS, 9], 8, seed=11)
    assert a == b
    gen = torch.Generator().manual_seed(11)
    assert policy.sample([BOS, 9], 8, generator=gen) == a
    hot_tokens, hot_lp = policy.sample([BOS, 9], 8, temperature=0.5, seed=11)
    # the logged logprob is that of the tempered distribution, not the T=1 score
    cold = policy.score([BOS, 9], hot_tokens)
    assert hot_lp != pytest.approx(cold, abs=1e-6)
    with pytest.raises(ValueError, match="temperature"):
        policy.sample([BOS], 3, temperature=0.0)


def test_batch_logprobs_ignore_padding() -> None:
    torch.manual_seed(1)
    policy = TinyTransformer(SMALL).eval()
    prompts = [[BOS, 4, 5], [BOS]]
    completions = [[7, 8], [9, 10, 11, EOS]]
    lp, mask = policy.batch_logprobs(prompts, completions)
    assert lp.shape == mask.shape == (2, 4)
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    for i in range(2):
        alone = policy.score(prompts[i], completions[i])
        assert lp[i, : len(completions[i])].tolist() == pytest.approx(alone, abs=1e-5)
    assert lp[0, 2:].abs().sum() == 0


def test_batch_logprobs_are_differentiable() -> None:
    policy = TinyTransformer(SMALL)
    lp, mask = policy.batch_logprobs([[BOS, 3]], [[4, 5]])
    (lp * mask).sum().backward()
    assert policy.tok.weight.grad is not None


def test_pad_batch_truncates_long_prompts_from_the_left() -> None:
    ids, attn, positions, targets, tmask = pad_batch([list(range(3, 60))], [[7, 8, 9]], max_len=10)
    assert attn.sum() == 10
    assert ids[0, :7].tolist() == list(range(53, 60))
    assert positions[0].tolist() == [6, 7, 8]
    assert targets[0].tolist() == [7, 8, 9]
    assert tmask[0].tolist() == [1, 1, 1]
    ids, _, _, _, _ = pad_batch([[]], [[5]])
    assert ids[0, 0] == BOS


def test_save_load_round_trip(tmp_path: Path) -> None:
    policy = TinyTransformer(SMALL)
    out = policy.save(tmp_path / "p")
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["kind"] == "tiny-transformer"
    assert manifest["config"]["d_model"] == 32
    loaded = load_policy(out)
    assert isinstance(loaded, Policy)
    assert loaded.score([BOS, 3], [4, 5, EOS]) == pytest.approx(policy.score([BOS, 3], [4, 5, EOS]))
    twin = policy.clone()
    assert twin is not policy
    assert twin.score([BOS], [4]) == pytest.approx(policy.score([BOS], [4]))


def test_load_policy_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"policy\.json"):
        load_policy(tmp_path)
    (tmp_path / MANIFEST).write_text(json.dumps({"kind": "nope", "config": {}}))
    with pytest.raises(ValueError, match="unknown policy kind"):
        load_policy(tmp_path)
