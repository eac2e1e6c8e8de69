"""The model ``rtrl demo --engine vllm`` serves: a tiny Llama-architecture model that already
does the simulated users' job, badly, as a team's own base model would.

:func:`build_demo_model` trains a byte-level BPE tokenizer in which every word of the chat
world (services/sim/chat_world.py) is one token, builds a seeded tiny ``LlamaForCausalLM``
(services/stack/tiny_llm.py) and fine-tunes it on the bootstrap corpus of the world written
as chat: the user's message through the chat template, the mediocre answer (now and then
a clarifying question) as words and ``<|im_end|>``. The result answers each task partly with
the words its users keep and always too long: what the LoRA increments of the loop improve
on. No hub download.

:func:`chat_pairs` writes world pairs as the model's token ids (``rtrl bootstrap``'s corpus
format), as the engine renders them: ``apply_chat_template`` for the prompt.

:func:`cached_demo_model` keeps each built model in a cache directory, keyed by everything
that shapes it (seed, sizes, the source of the modules that build it, torch and transformers
versions), so a second demo with the same seed starts its engine at once.

transformers, tokenizers and torch are imported inside the functions (heavy).
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from services.sim.agent import world_corpus
from services.sim.chat_world import ASK_WORD, CONTENT_WORDS, ChatVocab
from services.sim.users import World, bootstrap_corpus, make_world, question_completion
from services.stack.tiny_llm import build_tiny_llm

VOCAB = 1024
"""Room for every world word in two forms (sentence-initial and after a space) as one token."""
PRETRAIN_PAIRS = 2500
PRETRAIN_EPOCHS = 3
PRETRAIN_LR = 3e-3
AGENT_PRETRAIN_EPOCHS = 10
"""Epochs over the agents' turns (``--agent``): at 3 the model had not learnt the turn format
(it completed 5% of its sessions, seed 0); at 10 it completes 35-43% (seeds 0 and 5), about
as often as the middling agents it learns from, which leaves the loop room to improve."""
QUESTION_SHARE = 0.03
"""Share of pretraining answers that are a clarifying question: the base model asks now and
then, as real ones do (and an adapter can learn to ask, the reward hack the demo injects)."""
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The demo's adapters cover every linear layer: the tiny model has little to adapt elsewhere."""


def tokenizer_texts(world: World, seed: int, n: int = 3000) -> list[str]:
    """Training text for the demo tokenizer: the world's messages and answers, and every word
    alone and after a space, often enough that each becomes one token."""
    vocab, rng = ChatVocab(world), random.Random(f"tok-{seed}")
    texts = []
    for prompt, completion in bootstrap_corpus(n, seed):
        texts += [vocab.message(prompt), vocab.text(completion)]
    words = [*CONTENT_WORDS, ASK_WORD]
    for _ in range(40):
        rng.shuffle(words)
        texts += [*words, " ".join(words)]
    return texts


def chat_pairs(tokenizer: Any, world: World,
               pairs: Iterable[tuple[Sequence[int], Sequence[int]]]) -> list[tuple[list[int], list[int]]]:
    """World pairs as the model's ids: the chat-rendered prompt, the answer's words and EOS."""
    vocab = ChatVocab(world)
    eos = int(tokenizer.eos_token_id)
    out = []
    for prompt, completion in pairs:
        answer = tokenizer.encode(vocab.text(completion), add_special_tokens=False)
        out.append((chat_prompt_ids(tokenizer, vocab, prompt), [int(t) for t in answer] + [eos]))
    return out


def chat_prompt_ids(tokenizer: Any, vocab: ChatVocab, prompt: Sequence[int]) -> list[int]:
    """A world prompt as the engine sees it in a chat request: the user's message rendered by
    the model's chat template, with the assistant's turn opened."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": vocab.message(prompt)}],
                                        add_generation_prompt=True, tokenize=True)
    return [int(t) for t in _ids(ids)]


def _ids(rendered: Any) -> list[int]:
    """apply_chat_template's ids (a list, or a BatchEncoding in newer transformers)."""
    return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


def with_questions(pairs: Sequence[tuple[list[int], list[int]]], share: float,
                   seed: int) -> list[tuple[list[int], list[int]]]:
    """``pairs`` with about ``share`` of the answers replaced by a clarifying question (seeded)."""
    rng = random.Random(f"questions-{seed}")
    return [(p, question_completion() if rng.random() < share else c) for p, c in pairs]


def pretrain_pairs(n_pairs: int, seed: int, agent: bool = False) -> list[tuple[list[int], list[int]]]:
    """The base model's world pairs: one-shot answers with now and then a question, or with
    ``agent`` the turns of middling agents' sessions (services/sim/agent.py's
    :func:`world_corpus`: calls, questions and answers, some of them wrong)."""
    pairs = world_corpus(n_pairs, seed, agent)
    return pairs if agent else with_questions(pairs, QUESTION_SHARE, seed)


def build_demo_model(dst: Path, seed: int = 0, epochs: int = PRETRAIN_EPOCHS,
                     n_pairs: int = PRETRAIN_PAIRS, say: Callable[[str], None] = print,
                     agent: bool = False) -> Path:
    """The demo's base model and tokenizer under ``dst`` (see the module docstring); with
    ``agent``, an agent that works the agent world's sessions badly (``rtrl demo --agent
    --engine vllm``)."""
    import torch
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from trainer.hf_policy import HFPolicy
    from trainer.loop import LoopConfig, sft_train

    hf_logging.disable_progress_bar()  # the demo's console shows its own progress
    world = make_world(seed)
    build_tiny_llm(dst, seed, VOCAB, tokenizer_texts(world, seed))
    tokenizer = AutoTokenizer.from_pretrained(str(dst))
    pairs = chat_pairs(tokenizer, world, pretrain_pairs(n_pairs, seed, agent))
    torch.manual_seed(seed)
    policy = HFPolicy.from_pretrained(dst, dtype=torch.float32)
    t0 = time.monotonic()
    history = sft_train(policy, pairs, LoopConfig(batch_size=32, epochs=epochs, lr=PRETRAIN_LR, seed=seed))
    policy.model.eval()
    policy.model.save_pretrained(str(dst), safe_serialization=True)  # type: ignore[operator]
    say(f"base model trained on {len(pairs)} chat pairs x {epochs} epochs in {time.monotonic() - t0:.0f}s "
        f"(loss {history[0]['loss']:.2f} -> {history[-1]['loss']:.2f})")
    return dst


def word_tokens(tokenizer: Any) -> dict[str, list[int]]:
    """Each world word, after a space, as the tokenizer splits it (one id each when trained
    as :func:`build_demo_model` does)."""
    return {w: [int(t) for t in tokenizer.encode(" " + w, add_special_tokens=False)]
            for w in (*CONTENT_WORDS, ASK_WORD)}


BUILDER_SOURCES = ("services/demo/chat_model.py", "services/stack/tiny_llm.py", "services/sim/chat_world.py",
                   "services/sim/users.py", "services/sim/agent.py", "trainer/hf_policy.py",
                   "trainer/loop.py")
"""The modules whose code shapes the demo model: a change to any of them makes a new cache key."""
CACHE_DONE = "rtrl-cache.json"
"""Written last into a cached model: a directory without it is an interrupted build."""


def model_key(seed: int, epochs: int = PRETRAIN_EPOCHS, n_pairs: int = PRETRAIN_PAIRS,
              root: Path | None = None, agent: bool = False) -> str:
    """What the model built by :func:`build_demo_model` depends on, as a short hash."""
    import torch
    import transformers

    root = root or Path(__file__).resolve().parents[2]
    h = hashlib.sha256(json.dumps({
        "seed": seed, "epochs": epochs, "pairs": n_pairs, "vocab": VOCAB, "lr": PRETRAIN_LR,
        "questions": QUESTION_SHARE, "torch": torch.__version__, "transformers": transformers.__version__,
        "agent": agent,
    }, sort_keys=True).encode())
    for rel in BUILDER_SOURCES:
        h.update(rel.encode())
        h.update((root / rel).read_bytes())
    return h.hexdigest()[:16]


def cached_demo_model(dst: Path, seed: int, cache: Path | None, epochs: int = PRETRAIN_EPOCHS,
                      n_pairs: int = PRETRAIN_PAIRS, say: Callable[[str], None] = print,
                      build: Callable[..., Path] | None = None, agent: bool = False) -> Path:
    """The demo model under ``dst``: copied from ``cache`` when a finished build with the same
    key is there, else built (:func:`build_demo_model`) and then stored in ``cache`` (None: no
    cache). A cache that cannot be written costs only the copy: the model is still built."""
    build = build or build_demo_model
    if cache is None:
        return build(dst, seed, epochs=epochs, n_pairs=n_pairs, say=say, agent=agent)
    cache = cache.expanduser()
    key = model_key(seed, epochs, n_pairs, agent=agent)
    hit = cache / key
    if (hit / CACHE_DONE).exists():
        if dst.exists():
            shutil.rmtree(dst)
        shutil.copytree(hit, dst, ignore=shutil.ignore_patterns(CACHE_DONE))
        say(f"base model {key} from the cache {cache} (delete it to build again)")
        return dst
    build(dst, seed, epochs=epochs, n_pairs=n_pairs, say=say, agent=agent)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=cache))
        shutil.copytree(dst, tmp, dirs_exist_ok=True)
        (tmp / CACHE_DONE).write_text(json.dumps({"key": key, "seed": seed, "built_at": time.time()}) + "\n")
        try:
            tmp.rename(hit)
        except OSError:  # another demo stored the same key meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
        say(f"base model {key} stored in the cache {cache}")
    except OSError as exc:
        say(f"base model not cached ({type(exc).__name__}: {exc})")
    return dst
