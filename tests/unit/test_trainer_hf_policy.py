"""The Hugging Face adapter on a tiny GPT-2 built from a config and saved locally (no
downloads), loaded through the same from_pretrained path a user's model takes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from trainer.hf_policy import HFPolicy  # noqa: E402
from trainer.loop import LoopConfig, Sample, rl_train  # noqa: E402
from trainer.policy import Policy, load_policy, score_records  # noqa: E402


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                  bos_token_id=0, eos_token_id=1,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    d = tmp_path_factory.mktemp("tiny-gpt2")
    transformers.GPT2LMHeadModel(cfg).save_pretrained(d)
    return d


def test_sample_and_score_agree(tiny_dir: Path) -> None:
    policy = HFPolicy.from_pretrained(tiny_dir)
    assert isinstance(policy, Policy)
    tokens, logps = policy.sample([0, 5, 6], 10, seed=1)
    assert 1 <= len(tokens) <= 10 and len(logps) == len(tokens)
    assert policy.score([0, 5, 6], tokens) == pytest.approx(logps, abs=1e-4)
    assert policy.sample([0, 5, 6], 10, seed=1) == (tokens, logps)


def test_scored_at_the_sampling_temperature_it_matches_what_was_sampled(tiny_dir: Path) -> None:
    policy = HFPolicy.from_pretrained(tiny_dir)
    tokens, logps = policy.sample([0, 5, 6], 10, temperature=0.7, seed=1)
    [scored] = score_records(policy, [[0, 5, 6]], [tokens], temperatures=[0.7])
    assert scored == pytest.approx(logps, abs=1e-4)


def test_min_new_tokens_keeps_eos_out(tiny_dir: Path) -> None:
    policy = HFPolicy.from_pretrained(tiny_dir)
    with torch.no_grad():  # the final features become e_0, which only EOS (id 1) reads
        ln_f = policy.model.transformer.ln_f
        ln_f.weight.zero_()
        ln_f.bias.zero_()
        ln_f.bias[0] = 1.0
        policy.model.lm_head.weight[:, 0] = 0.0
        policy.model.lm_head.weight[1, 0] = 50.0
    assert policy.sample([0, 5], 6, seed=2)[0] == [1]
    tokens, logps = policy.sample([0, 5], 6, seed=2, min_new_tokens=3)
    assert len(tokens) >= 3 and 1 not in tokens[:3]
    assert all(lp <= 0.0 for lp in logps)


def test_batch_logprobs_ignore_padding(tiny_dir: Path) -> None:
    policy = HFPolicy.from_pretrained(tiny_dir)
    prompts, completions = [[0, 4], [0, 7, 8, 9]], [[5, 6, 7], [3]]
    with torch.no_grad():
        lp, mask = policy.batch_logprobs(prompts, completions)
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    for i in range(2):
        assert lp[i, : len(completions[i])].tolist() == pytest.approx(
            policy.score(prompts[i], completions[i]), abs=1e-5)


def test_save_load_and_train_step(tiny_dir: Path, tmp_path: Path) -> None:
    policy = HFPolicy.from_pretrained(tiny_dir)
    saved = policy.save(tmp_path / "p")
    assert (saved / "model" / "config.json").exists()
    loaded = load_policy(saved)
    assert isinstance(loaded, HFPolicy)
    assert loaded.score([0, 3], [4, 1]) == pytest.approx(policy.score([0, 3], [4, 1]), abs=1e-5)
    # the same RL loop trains it
    samples = [Sample([0, 3], [9, 1], policy.score([0, 3], [9, 1]), 1.0),
               Sample([0, 3], [8, 1], policy.score([0, 3], [8, 1]), -1.0)] * 4
    before = policy.score([0, 3], [9])[0]
    rl_train(loaded, policy.clone(), samples, LoopConfig(batch_size=8, epochs=3, lr=3e-3))
    assert loaded.score([0, 3], [9])[0] > before
