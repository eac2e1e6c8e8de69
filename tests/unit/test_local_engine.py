"""The local vLLM engine's command line and the tiny model built for it (no engine started)."""

from __future__ import annotations

from pathlib import Path

import pytest

from deployer.engine import CHECK_TEXT as CHECK_PROMPT
from services.stack.engine import EngineError, LocalVllm, server_argv, server_env
from services.stack.tiny_llm import (
    build_lora_adapter,
    build_tiny_llm,
    corpus,
    corrupt_adapter,
    reference_logprobs,
)
from trainer.lora_policy import check_prompt_ids

pytestmark = pytest.mark.unit


def test_the_engine_runs_with_runtime_lora_sampled_logprobs_and_tool_calls() -> None:
    argv = server_argv(Path("/v/bin/python"), Path("/m"), "base", 8123)
    joined = " ".join(argv)
    assert "vllm.entrypoints.openai.api_server" in joined and "--served-model-name base" in joined
    assert "--enable-lora" in argv and "--logprobs-mode processed_logprobs" in joined
    assert "--port 8123" in joined and "--host 127.0.0.1" in joined
    assert "--enable-auto-tool-choice" in argv and "--tool-call-parser hermes" in joined  # serves tools
    env = server_env({"PYTHONPATH": "/rtrl", "HOME": "/root"})
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True" and "PYTHONPATH" not in env


def test_a_missing_venv_names_the_command_that_makes_it(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match="scripts/vllm-env"):
        LocalVllm(tmp_path, "base", tmp_path / "log", venv=tmp_path / "nope")


def test_the_corpus_is_deterministic() -> None:
    assert corpus(seed=3) == corpus(seed=3) != corpus(seed=4)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llm(tmp_path_factory.mktemp("tiny") / "base")


def test_the_tiny_model_has_a_tokenizer_with_a_chat_template(tiny: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny))
    assert tok.decode(tok.encode(CHECK_PROMPT)) == CHECK_PROMPT  # byte-level BPE round-trips
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<pad>"
    assert check_prompt_ids(tiny) == tok.encode(CHECK_PROMPT)


def test_an_adapter_changes_the_logprobs_and_a_corrupt_one_has_no_weights(tiny: Path, tmp_path: Path) -> None:
    ids = check_prompt_ids(tiny)
    base = reference_logprobs(tiny, None, ids)
    adapter = build_lora_adapter(tiny, tmp_path / "a", seed=1)
    tuned = reference_logprobs(tiny, adapter, ids)
    assert base[0] is None and tuned[0] is None and len(base) == len(ids)
    assert max(abs(float(a) - float(b)) for a, b in zip(base[1:], tuned[1:], strict=True)) > 0.01
    assert reference_logprobs(tiny, adapter, ids) == tuned  # deterministic
    bad = corrupt_adapter(adapter, tmp_path / "bad")
    assert (bad / "adapter_config.json").exists() and (bad / "adapter_model.safetensors").stat().st_size == 16
