"""LoRA increments on a Hugging Face causal LM: the base model stays frozen and each increment
trains a PEFT LoRA adapter, starting from its parent's adapter.

A saved version is small and loads in an inference engine as is::

    policy.json          {"kind": "hf-lora", "config": {"base": DIR, "base_sha256": ..., "lora": {...}}}
    adapter/             PEFT's save_pretrained (adapter_config.json, adapter_model.safetensors)
    engine_check.json    the fixed prompt and this policy's own log-probabilities of it

The base model (and its tokenizer) is referenced by a content hash over its weights, config
and tokenizer files (:func:`content_hash`), so a version never silently trains or serves on
another base. Where the base lives may differ between machines: ``RTRL_TRAINER__BASE_MODEL_DIR``
names it here and is checked against the hash. An adapter that is still the identity (every
``lora_B`` zero, e.g. a bootstrap with no training) is marked ``"engine": "base"``: the engine
serves it as its base model, with no adapter to load.

transformers and peft are optional extras (``pip install 'rtrl[hf]'``), imported lazily.
"""

from __future__ import annotations

import copy
import hashlib
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from deployer.engine import CHECK_TEXT, CHECK_TOKENS, Greedy, write_check
from ingest.contracts.registry import ADAPTER_DIR
from trainer.hf_policy import HFPolicy, transformers_lib
from trainer.policy import write_manifest

BASE_DIR_ENV = "RTRL_TRAINER__BASE_MODEL_DIR"
"""Where the base model is on this machine, when not where the version was trained."""

_BASE_PATTERNS = ("config.json", "*.safetensors", "*.bin", "*.safetensors.index.json", "tokenizer*",
                  "special_tokens_map.json", "vocab.*", "merges.txt", "*.model", "chat_template*")
_hashes: dict[tuple[str, tuple[tuple[str, int, int], ...]], str] = {}


@dataclass(frozen=True)
class LoraSpec:
    """The adapter's shape: what a user would pass to ``peft.LoraConfig``."""

    rank: int = 8
    alpha: int = 16
    targets: tuple[str, ...] = ("q_proj", "v_proj")
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.rank < 1 or self.alpha <= 0 or not self.targets or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"invalid LoRA spec {self}: "
                             "rank >= 1, alpha > 0, targets given, 0 <= dropout < 1")

    def peft_config(self) -> Any:
        from peft import LoraConfig

        return LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout,
                          target_modules=list(self.targets), bias="none", task_type="CAUSAL_LM")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LoraSpec:
        return cls(int(data.get("rank", 8)), int(data.get("alpha", 16)),
                   tuple(data.get("targets", ("q_proj", "v_proj"))), float(data.get("dropout", 0.0)))


def base_files(base_dir: Path) -> list[Path]:
    """The files that define a base model and its tokenizer (sorted, top level only)."""
    found = {p for pattern in _BASE_PATTERNS for p in base_dir.glob(pattern) if p.is_file()}
    return sorted(found, key=lambda p: p.name)


def content_hash(base_dir: str | Path) -> str:
    """sha256 over the base model's defining files (names and bytes); cached per process while
    the files' sizes and modification times stay the same."""
    base_dir = Path(base_dir)
    files = base_files(base_dir)
    if not any(p.name == "config.json" for p in files):
        raise FileNotFoundError(f"{base_dir} holds no config.json: not a Hugging Face model directory")
    key = (str(base_dir.resolve()), tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files))
    if key not in _hashes:
        digest = hashlib.sha256()
        for p in files:
            digest.update(p.name.encode() + b"\0")
            with p.open("rb") as f:
                while chunk := f.read(1 << 20):
                    digest.update(chunk)
        _hashes[key] = digest.hexdigest()
    return _hashes[key]


def resolve_base(config: dict[str, Any]) -> Path:
    """The base model directory for a saved version: ``RTRL_TRAINER__BASE_MODEL_DIR`` when set,
    else the path recorded at training; its content hash must match the recorded one."""
    recorded = str(config.get("base", ""))
    path = Path(os.environ.get(BASE_DIR_ENV) or recorded)
    want = str(config.get("base_sha256", ""))
    if not path.is_dir():
        raise FileNotFoundError(f"the base model of this LoRA version is not at {path} (trained on "
                                f"{recorded}, sha256 {want[:12]}): set {BASE_DIR_ENV} to where it is")
    got = content_hash(path)
    if want and got != want:
        raise ValueError(f"the base model at {path} has sha256 {got[:12]}, but this version was trained on "
                         f"{want[:12]}: the adapter belongs to another base model")
    return path


class LoRAPolicy(HFPolicy):
    """A frozen base model with a trainable LoRA adapter (a ``peft.PeftModel``)."""

    kind = "hf-lora"

    def __init__(self, model: nn.Module, base_dir: Path, base_sha256: str, spec: LoraSpec) -> None:
        super().__init__(model)
        self.base_dir, self.base_sha256, self.spec = base_dir, base_sha256, spec

    @classmethod
    def create(cls, base_dir: str | Path, spec: LoraSpec | None = None, seed: int = 0) -> LoRAPolicy:
        """A new adapter on the base model; PEFT starts ``lora_B`` at zero, so it is the base."""
        from peft import get_peft_model

        base_dir, spec = Path(base_dir), spec or LoraSpec()
        torch.manual_seed(seed)
        model = get_peft_model(_base_model(base_dir), spec.peft_config())
        return cls(model, base_dir, content_hash(base_dir), spec)

    @classmethod
    def load(cls, directory: str | Path, config: dict[str, Any]) -> LoRAPolicy:
        from peft import PeftModel

        base_dir = resolve_base(config)
        adapter = Path(directory) / ADAPTER_DIR
        if not (adapter / "adapter_config.json").is_file():
            raise FileNotFoundError(f"{directory} holds no LoRA adapter ({ADAPTER_DIR}/adapter_config.json)")
        model = PeftModel.from_pretrained(_base_model(base_dir), str(adapter), is_trainable=True)
        return cls(model, base_dir, str(config.get("base_sha256") or content_hash(base_dir)),
                   LoraSpec.from_dict(config.get("lora", {})))

    def clone(self) -> LoRAPolicy:
        return LoRAPolicy(copy.deepcopy(self.model), self.base_dir, self.base_sha256, self.spec)

    def is_identity(self) -> bool:
        """Whether the adapter changes nothing: every ``lora_B`` weight is zero."""
        return all(not bool(p.detach().any()) for n, p in self.model.named_parameters() if "lora_B" in n)

    def save(self, directory: str | Path) -> Path:
        directory = Path(directory)
        config = {"base": str(self.base_dir), "base_sha256": self.base_sha256, "lora": asdict(self.spec)}
        write_manifest(directory, self.kind, config, **({"engine": "base"} if self.is_identity() else {}))
        self.model.save_pretrained(str(directory / ADAPTER_DIR))  # type: ignore[operator]
        ids = check_prompt_ids(self.base_dir, int(getattr(self.model.config, "vocab_size", 0) or 0))
        write_check(directory, ids, self.prompt_logprobs(ids), greedy_continuation(self.model, ids))
        return directory

    @torch.inference_mode()
    def prompt_logprobs(self, ids: list[int]) -> list[float | None]:
        """Each token's log-probability given the ones before it (None for the first): what an
        engine returns as ``prompt_logprobs``."""
        was_training = self.model.training
        self.model.eval()
        logits = self.model(input_ids=torch.tensor([ids], device=self._device())).logits[0].float()
        self.model.train(was_training)
        logps = torch.log_softmax(logits, dim=-1)
        return [None] + [float(logps[i - 1, ids[i]]) for i in range(1, len(ids))]


@torch.inference_mode()
def greedy_continuation(model: nn.Module, ids: list[int], n: int = CHECK_TOKENS) -> Greedy:
    """``model``'s greedy continuation of ``ids`` for ``n`` tokens (end of text ignored), each
    token's log-probability and its margin over the runner-up: what the engine must reproduce
    (deployer/engine.py)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    seq, tokens, logprobs, margins = list(ids), [], [], []
    for _ in range(n):
        logits = model(input_ids=torch.tensor([seq], device=device)).logits[0, -1].float()
        top = torch.topk(torch.log_softmax(logits, dim=-1), 2)
        token = int(top.indices[0])
        tokens.append(token)
        logprobs.append(float(top.values[0]))
        margins.append(float(top.values[0] - top.values[1]))
        seq.append(token)
    model.train(was_training)
    return Greedy(tokens, logprobs, margins)


def _base_model(base_dir: Path) -> nn.Module:
    model: nn.Module = transformers_lib().AutoModelForCausalLM.from_pretrained(str(base_dir),
                                                                            dtype=torch.float32)
    return model


def check_prompt_ids(base_dir: Path, vocab_size: int = 0) -> list[int]:
    """The fixed check prompt under the base model's tokenizer; without a tokenizer, the first
    ids of a ``vocab_size`` vocabulary (the check needs a prompt, not words)."""
    try:
        tokenizer = transformers_lib().AutoTokenizer.from_pretrained(str(base_dir))
        ids = [int(t) for t in tokenizer.encode(CHECK_TEXT)]
    except (OSError, ValueError):
        ids = []
    if len(ids) >= 2:
        return ids
    return list(range(1, min(vocab_size, 17))) if vocab_size > 2 else [0, 1]

