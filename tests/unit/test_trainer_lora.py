"""LoRA increments on a tiny Llama model built here (no hub): the base stays frozen, the saved
version is the adapter with a content-hashed reference to its base, and it chains."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from training_helpers import killed_and_resumed

from deployer.engine import CHECK_TOKENS, find_adapter, is_base, read_check
from deployer.registry import manifest_tags
from ingest.contracts.registry import Tag
from services.stack.tiny_llm import build_tiny_llm, reference_greedy, reference_logprobs
from trainer.hf_policy import HFPolicy
from trainer.loop import (
    LoopConfig,
    Sample,
    make_optimizer,
    rl_train,
)
from trainer.lora_policy import (
    BASE_DIR_ENV,
    LoRAPolicy,
    LoraSpec,
    check_prompt_ids,
    content_hash,
)
from trainer.policy import load_policy, n_trainable

pytestmark = pytest.mark.unit

PROMPT, GOOD, BAD = [0, 40, 41, 42], [50, 51, 52], [60, 61, 62]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llm(tmp_path_factory.mktemp("lora") / "base")


def samples(policy: LoRAPolicy) -> list[Sample]:
    return [Sample(PROMPT, GOOD, policy.score(PROMPT, GOOD), 1.0),
            Sample(PROMPT, BAD, policy.score(PROMPT, BAD), -1.0)] * 4


def trained(base: Path, parent: LoRAPolicy | None = None, lr: float = 1e-2) -> LoRAPolicy:
    policy = parent.clone() if parent is not None else LoRAPolicy.create(base, LoraSpec(rank=4, alpha=8))
    rl_train(policy, policy.clone(), samples(policy), LoopConfig(batch_size=8, epochs=3, lr=lr))
    return policy


def base_weights(policy: LoRAPolicy) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in policy.model.named_parameters() if "lora_" not in n}


def test_a_new_adapter_is_the_base_model_and_is_saved_as_the_engines_base(base: Path, tmp_path: Path) -> None:
    policy = LoRAPolicy.create(base)
    assert policy.is_identity()
    assert policy.score(PROMPT, GOOD) == pytest.approx(HFPolicy.from_pretrained(base).score(PROMPT, GOOD),
                                                       abs=1e-5)
    saved = policy.save(tmp_path / "v1")
    manifest = json.loads((saved / "policy.json").read_text())
    assert manifest["kind"] == "hf-lora" and manifest["engine"] == "base" and is_base(saved)
    assert manifest["config"]["base_sha256"] == content_hash(base)
    check = read_check(saved)
    ids = check.prompt_ids
    assert ids == check_prompt_ids(base) and len(ids) >= 2
    assert check.prompt_logprobs == pytest.approx(reference_logprobs(base, None, ids), abs=1e-5)
    assert check.greedy is not None and len(check.greedy.token_ids) == CHECK_TOKENS
    assert check.greedy.token_ids == reference_greedy(base, None, ids).token_ids


def test_an_increment_trains_only_the_adapter_and_saves_it_small(base: Path, tmp_path: Path) -> None:
    policy = LoRAPolicy.create(base, LoraSpec(rank=4, alpha=8))
    frozen = base_weights(policy)
    optimizer = make_optimizer(policy, 1e-3)
    n_opt = sum(p.numel() for group in optimizer.param_groups for p in group["params"])
    assert n_opt == n_trainable(policy.module) < sum(p.numel() for p in frozen.values()) / 10
    before = policy.score(PROMPT, GOOD)
    rl_train(policy, policy.clone(), samples(policy), LoopConfig(batch_size=8, epochs=3, lr=1e-2))
    assert sum(policy.score(PROMPT, GOOD)) > sum(before)
    assert all(torch.equal(frozen[n], p) for n, p in base_weights(policy).items())
    assert not policy.is_identity()
    saved = policy.save(tmp_path / "v2")
    assert not is_base(saved)
    adapter = find_adapter(saved)
    assert adapter is not None and adapter.name == "adapter"
    weights = sum(f.stat().st_size for f in adapter.iterdir())
    assert weights < sum(f.stat().st_size for f in base.glob("*.safetensors")) / 10
    # its check is what HF + PEFT compute from the saved files alone
    check = read_check(saved)
    want_lps = reference_logprobs(base, adapter, check.prompt_ids)
    assert check.prompt_logprobs == pytest.approx(want_lps, abs=1e-4)
    want = reference_greedy(base, adapter, check.prompt_ids)
    assert check.greedy is not None and check.greedy.token_ids == want.token_ids
    assert check.greedy.logprobs == pytest.approx(want.logprobs, abs=1e-4)
    assert all(m >= 0 for m in check.greedy.margins)
    loaded = load_policy(saved)
    assert isinstance(loaded, LoRAPolicy) and loaded.spec == LoraSpec(rank=4, alpha=8)
    assert loaded.score(PROMPT, GOOD) == pytest.approx(policy.score(PROMPT, GOOD), abs=1e-5)
    assert n_trainable(loaded.module) == n_trainable(policy.module)


def test_increments_chain_from_the_parents_adapter(base: Path, tmp_path: Path) -> None:
    parent_dir = trained(base).save(tmp_path / "parent")
    parent = load_policy(parent_dir)
    assert isinstance(parent, LoRAPolicy)
    parent_score = parent.score(PROMPT, GOOD)
    child = trained(base, parent)
    child_dir = child.save(tmp_path / "child")
    assert sum(load_policy(child_dir).score(PROMPT, GOOD)) > sum(parent_score)
    assert load_policy(parent_dir).score(PROMPT, GOOD) == pytest.approx(parent_score, abs=1e-6)


def test_a_killed_increment_resumes_to_the_same_adapter(base: Path, tmp_path: Path) -> None:
    """A checkpoint holds the adapter and its optimiser: resuming equals not being killed."""
    start = LoRAPolicy.create(base, LoraSpec(rank=4, alpha=8))
    cfg = LoopConfig(batch_size=4, epochs=2, lr=1e-2)
    full, resumed, _ = killed_and_resumed(start, samples(start), cfg, 3, tmp_path / "ck")
    assert isinstance(resumed, LoRAPolicy)
    assert resumed.score(PROMPT, GOOD) == pytest.approx(full.score(PROMPT, GOOD), abs=1e-5)
    assert resumed.score(PROMPT, GOOD) != pytest.approx(start.score(PROMPT, GOOD), abs=1e-3)


def test_the_base_is_found_by_content_not_by_path(base: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    saved = trained(base).save(tmp_path / "v")
    want = load_policy(saved).score(PROMPT, GOOD)
    moved = tmp_path / "elsewhere"
    shutil.copytree(base, moved)
    monkeypatch.setenv(BASE_DIR_ENV, str(moved))
    assert load_policy(saved).score(PROMPT, GOOD) == pytest.approx(want, abs=1e-6)
    # another base model (other weights) is refused by name
    other = build_tiny_llm(tmp_path / "other", seed=3)
    monkeypatch.setenv(BASE_DIR_ENV, str(other))
    with pytest.raises(ValueError, match="another base model"):
        load_policy(saved)
    monkeypatch.setenv(BASE_DIR_ENV, str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match=BASE_DIR_ENV):
        load_policy(saved)


def test_content_hash_covers_weights_and_tokenizer(base: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(base, copy)
    assert content_hash(copy) == content_hash(base)
    (copy / "tokenizer.json").write_text((copy / "tokenizer.json").read_text().replace("im_end", "im_fin"))
    assert content_hash(copy) != content_hash(base)
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        content_hash(tmp_path)


def test_registry_tags_name_the_kind_and_the_base(base: Path, tmp_path: Path) -> None:
    saved = LoRAPolicy.create(base).save(tmp_path / "v")
    assert manifest_tags(saved) == {Tag.POLICY_KIND: "hf-lora", Tag.BASE_MODEL: str(base),
                                    Tag.BASE_SHA256: content_hash(base)}
    full = HFPolicy.from_pretrained(base).save(tmp_path / "full")
    assert manifest_tags(full) == {Tag.POLICY_KIND: "hf"}


def test_a_missing_adapter_and_bad_specs_are_clear_errors(base: Path, tmp_path: Path) -> None:
    saved = LoRAPolicy.create(base).save(tmp_path / "v")
    shutil.rmtree(saved / "adapter")
    with pytest.raises(FileNotFoundError, match="no LoRA adapter"):
        load_policy(saved)
    for bad in ({"rank": 0}, {"alpha": 0}, {"targets": ()}, {"dropout": 1.0}):
        with pytest.raises(ValueError, match=r"invalid LoRA spec"):
            LoraSpec(**bad)  # type: ignore[arg-type]


def test_check_prompt_without_a_tokenizer(tmp_path: Path) -> None:
    assert check_prompt_ids(tmp_path, vocab_size=100) == list(range(1, 17))
    assert check_prompt_ids(tmp_path) == [0, 1]


def test_the_length_guard_samples_an_adapter_as_it_samples_the_base(base: Path) -> None:
    """The band's length guard samples from a LoRA policy too, in train mode or not, and an
    adapter that has not moved has not moved the length."""
    from trainer.trust_region import KLBand, LengthProbe

    policy = LoRAPolicy.create(base, LoraSpec(rank=4, alpha=8))
    probe = LengthProbe(policy, samples(policy), 8)
    assert probe.max_new == 3 and probe.min_new == 1 and 1 <= probe.parent_mean <= 3
    assert probe.change(policy.clone()) == 0.0
    policy.module.train()
    band = KLBand(0.0, 50.0, probe_every=1, max_epochs=1, max_length_change=0.5, length_probe_size=8)
    history = rl_train(policy, policy.clone(), samples(policy), LoopConfig(batch_size=8, lr=1e-2, band=band))
    assert "probe_length_change" in history[-1] and policy.module.training
