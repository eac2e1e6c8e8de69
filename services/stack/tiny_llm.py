"""A tiny Llama-architecture model with its own byte-level BPE tokenizer, built locally (no hub
download), and LoRA adapters for it: what the tests, benchmarks and demo serve on a real
inference engine (vLLM's CPU build) on a machine without GPUs or network.

* :func:`build_tiny_llm` trains a byte-level BPE tokenizer on a generated corpus of
  code-assistant text, wraps it as a ``PreTrainedTokenizerFast`` (bos/eos/pad, a ChatML chat
  template) and saves it with a seeded ``LlamaForCausalLM`` (hidden 128, 4 heads: head_dim 32,
  the least vLLM's CPU attention backend accepts).
* :func:`build_lora_adapter` saves a PEFT LoRA adapter (q_proj, v_proj) with non-zero
  weights, so it changes the model's outputs.
* :func:`corrupt_adapter` copies an adapter with a truncated weights file.
* :func:`reference_logprobs` and :func:`reference_greedy` compute a prompt's per-token
  log-probabilities and its greedy continuation with HF (+PEFT): what the deployer compares
  the engine's answer with before a candidate serves (deployer/engine.py);
  :func:`write_engine_check` writes them as ``engine_check.json``.

transformers, tokenizers, peft and torch are imported inside the functions (heavy).
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

from deployer.engine import Greedy, write_check

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
VOCAB_SIZE = 512

_SUBJECTS = ["the loop", "this function", "the parser", "the test", "the cache", "the request handler",
             "the config loader", "the query", "the retry logic", "the import"]
_VERBS = ["fix", "rename", "refactor", "simplify", "document", "speed up", "test", "type", "split", "inline"]
_CODE = ["for i in range(n):\n    total += i", "def area(r):\n    return 3.14 * r * r",
         "if x is None:\n    return []", "with open(path) as f:\n    data = f.read()",
         "items = sorted(items, key=len)", "class Point:\n    x: int\n    y: int",
         "try:\n    run()\nexcept ValueError:\n    pass", "return {k: v for k, v in pairs}"]


def corpus(n: int = 600, seed: int = 0) -> list[str]:
    """Deterministic code-assistant text: requests, answers and code."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        subject, verb, code = rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_CODE)
        lines.append(f"Please {verb} {subject}.")
        lines.append(f"Here is the change to {subject}:\n{code}")
        lines.append(f"Should I also {rng.choice(_VERBS)} {rng.choice(_SUBJECTS)}?")
    return lines


def build_tokenizer(dst: Path, seed: int = 0, vocab_size: int = VOCAB_SIZE,
                    texts: list[str] | None = None) -> Any:
    """A byte-level BPE tokenizer trained on ``texts`` (default: :func:`corpus`), with the chat
    template and special tokens, saved under ``dst``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(seed=seed) if texts is None else texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIAL[0], eos_token=SPECIAL[2],
                                   pad_token=SPECIAL[3], unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(dst))
    return fast


def build_tiny_llm(dst: Path, seed: int = 0, vocab_size: int = VOCAB_SIZE,
                   texts: list[str] | None = None) -> Path:
    """Tokenizer (see :func:`build_tokenizer`) and a seeded tiny ``LlamaForCausalLM`` saved
    under ``dst``; returns ``dst``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    dst.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(dst, seed, vocab_size, texts)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(str(dst), safe_serialization=True)
    return dst


def build_lora_adapter(base_dir: Path, dst: Path, seed: int = 1, rank: int = 8, scale: float = 0.5) -> Path:
    """A PEFT LoRA adapter for the model in ``base_dir`` whose B matrices are non-zero (random,
    seeded), so it changes outputs; saved under ``dst``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(base_dir), torch_dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                                  target_modules=["q_proj", "v_proj"]))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
    peft_model.save_pretrained(str(dst))
    return dst


def corrupt_adapter(src: Path, dst: Path) -> Path:
    """A copy of the adapter in ``src`` whose weights file is cut to a few bytes."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    return truncate_weights(dst)


def truncate_weights(adapter_dir: Path) -> Path:
    """Cut the adapter's weights file(s) in ``adapter_dir`` to 16 bytes (a broken upload)."""
    for weights in adapter_dir.glob("adapter_model.*"):
        weights.write_bytes(weights.read_bytes()[:16])
    return adapter_dir


def _reference_model(model_dir: Path, adapter_dir: Path | None) -> Any:
    """The model in ``model_dir`` by HF transformers alone (with the PEFT adapter when given)."""
    import torch
    from transformers import LlamaForCausalLM

    model: Any = LlamaForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir))
    model.eval()
    return model


def reference_logprobs(model_dir: Path, adapter_dir: Path | None,
                       prompt_ids: list[int]) -> list[float | None]:
    """Log-probability of each prompt token given the ones before it (None for the first),
    computed by HF transformers (with the PEFT adapter when given)."""
    import torch

    model = _reference_model(model_dir, adapter_dir)
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids])).logits[0]
    logps = torch.log_softmax(logits.float(), dim=-1)
    return [None] + [float(logps[i - 1, prompt_ids[i]]) for i in range(1, len(prompt_ids))]


def reference_greedy(model_dir: Path, adapter_dir: Path | None, prompt_ids: list[int]) -> Greedy:
    """The greedy continuation of the prompt by HF transformers (with the PEFT adapter)."""
    from trainer.lora_policy import greedy_continuation

    return greedy_continuation(_reference_model(model_dir, adapter_dir), prompt_ids)


def write_engine_check(version_dir: Path, model_dir: Path, adapter_dir: Path | None,
                       prompt_ids: list[int]) -> Path:
    """``engine_check.json`` for a version: the fixed prompt, its reference log-probabilities
    and greedy continuation."""
    return write_check(version_dir, prompt_ids, reference_logprobs(model_dir, adapter_dir, prompt_ids),
                       reference_greedy(model_dir, adapter_dir, prompt_ids))

