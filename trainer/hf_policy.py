"""A Hugging Face ``transformers`` causal LM behind the :class:`trainer.policy.Policy` interface.

Token ids are the model's own tokenizer ids (the serving layer logs them). The saved
directory holds ``policy.json`` (kind ``hf``) and the model in ``model/`` exactly as
``save_pretrained`` writes it, so ``from_pretrained`` on that folder works outside rtrl too.
``transformers`` is an optional extra (``pip install 'rtrl[hf]'``) and is imported lazily.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from trainer.policy import completion_logprobs, pad_batch, sampling_generator, write_manifest


def transformers_lib() -> Any:
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError("the hf policy needs transformers: pip install 'rtrl[hf]'") from exc
    return transformers


class HFPolicy:
    kind = "hf"

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        cfg = getattr(model, "config", None)
        positions = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
        self.max_len: int | None = positions
        self.bos: int = int(getattr(cfg, "bos_token_id", None) or 0)
        eos = getattr(cfg, "eos_token_id", None)
        self.eos: set[int] = set(eos) if isinstance(eos, list) else ({int(eos)} if eos is not None else set())

    @classmethod
    def from_pretrained(cls, name_or_dir: str | Path, **kwargs: Any) -> HFPolicy:
        model = transformers_lib().AutoModelForCausalLM.from_pretrained(str(name_or_dir), **kwargs)
        model.eval()
        return cls(model)

    @classmethod
    def load(cls, directory: str | Path, config: dict[str, Any]) -> HFPolicy:
        return cls.from_pretrained(Path(directory) / config.get("subdir", "model"))

    @property
    def module(self) -> nn.Module:
        return self.model

    def clone(self) -> HFPolicy:
        return HFPolicy(copy.deepcopy(self.model))

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def batch_logprobs(
        self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
        temperatures: Sequence[float] | None = None,
    ) -> tuple[Tensor, Tensor]:
        prompts = [list(p) or [self.bos] for p in prompts]
        ids, attn, positions, targets, tmask = pad_batch(prompts, completions, self.max_len)
        dev = self._device()
        logits = self.model(input_ids=ids.to(dev), attention_mask=attn.to(dev)).logits
        lp = completion_logprobs(logits, positions.to(dev), targets.to(dev), tmask.to(dev), temperatures)
        return lp, tmask.to(dev)

    @torch.inference_mode()
    def sample(
        self,
        prompt_tokens: Sequence[int],
        max_new_tokens: int,
        temperature: float = 1.0,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        min_new_tokens: int = 0,
    ) -> tuple[list[int], list[float]]:
        generator = sampling_generator(temperature, seed, generator)
        self.model.eval()
        dev = self._device()
        x = torch.tensor([list(prompt_tokens) or [self.bos]], dtype=torch.long, device=dev)
        past = None
        out: list[int] = []
        logps: list[float] = []
        while len(out) < max_new_tokens:
            res = self.model(input_ids=x, past_key_values=past, use_cache=True)
            past = res.past_key_values
            logits = res.logits[0, -1].float().cpu() / temperature
            if len(out) < min_new_tokens:
                logits[list(self.eos)] = float("-inf")
            logp = torch.log_softmax(logits, dim=-1)
            token = int(torch.multinomial(logp.exp(), 1, generator=generator))
            out.append(token)
            logps.append(float(logp[token]))
            if token in self.eos:
                break
            x = torch.tensor([[token]], dtype=torch.long, device=dev)
        return out, logps

    @torch.inference_mode()
    def score(self, prompt_tokens: Sequence[int], completion_tokens: Sequence[int]) -> list[float]:
        if not completion_tokens:
            return []
        self.model.eval()
        lp, _ = self.batch_logprobs([prompt_tokens], [completion_tokens])
        return [float(v) for v in lp[0, : len(completion_tokens)]]

    def save(self, directory: str | Path) -> Path:
        directory = Path(directory)
        write_manifest(directory, self.kind, {"subdir": "model"})
        self.model.save_pretrained(directory / "model")  # type: ignore[operator]
        return directory
