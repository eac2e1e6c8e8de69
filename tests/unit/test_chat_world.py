"""The simulated world in words: what chat users write and how they read an answer."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from services.sim.chat_world import ASK_WORD, CONTENT_WORDS, ChatVocab
from services.sim.users import (
    draw_task,
    make_population,
    make_prompt,
    make_world,
    mediocre_completion,
    react,
)
from trainer.tokens import ASK, BOS, EOS, FIRST_CONTENT, VOCAB_SIZE, completion_kind


def test_every_content_id_has_one_distinct_word() -> None:
    words = [ChatVocab.word(t) for t in range(FIRST_CONTENT, VOCAB_SIZE)]
    assert words == list(CONTENT_WORDS) and len(set(words)) == VOCAB_SIZE - FIRST_CONTENT
    assert ChatVocab.word(ASK) == ASK_WORD and ASK_WORD not in words
    assert all(w.isalpha() and w == w.lower() for w in words), "one token each needs plain words"
    for special in (BOS, EOS, VOCAB_SIZE):
        with pytest.raises(ValueError, match="no word"):
            ChatVocab.word(special)


@pytest.mark.parametrize("seed", [0, 1, 7, 101])
def test_a_written_completion_reads_back_as_itself(seed: int) -> None:
    world = make_world(seed)
    vocab, rng = ChatVocab(world), random.Random(seed)
    for _ in range(50):
        task = draw_task(world, rng)
        completion = mediocre_completion(task, world, rng)
        assert completion[-1] == EOS
        assert vocab.read(vocab.text(completion)) == completion[:-1]
        prompt = make_prompt(task, world, rng)
        message = vocab.message(prompt)
        assert vocab.read(message) == prompt[1:] and message.split()[0] == ChatVocab.word(task.marker)


@pytest.mark.parametrize("seed", [0, 3, 11, 202])
def test_unknown_words_read_as_a_token_no_task_wants(seed: int) -> None:
    world = make_world(seed)
    vocab = ChatVocab(world)
    wanted = {t for task in world.tasks for t in task.preferred}
    assert vocab.unwanted not in wanted
    ids = vocab.read("loop loops Loop lo op ?? 日本 loop")
    loop = FIRST_CONTENT + CONTENT_WORDS.index("loop")
    assert ids == [loop] + [vocab.unwanted] * 6 + [loop]


def test_questions_and_empty_answers() -> None:
    vocab = ChatVocab(make_world(0))
    assert completion_kind(vocab.read("which one do you mean?")) == "question"
    assert completion_kind(vocab.read("Which?")) == "question"
    assert completion_kind(vocab.read("loop which")) == "edit", "only a first question word asks"
    assert vocab.read("") == [] and vocab.read(" \n\t ") == []
    assert completion_kind(vocab.read("")) == "empty"
    assert vocab.text([ASK, EOS]) == ASK_WORD


def test_a_user_reacts_to_the_words_as_to_the_ids() -> None:
    """Reading the written answer gives the reaction the ids would have (same draws)."""
    world = make_world(5)
    vocab = ChatVocab(world)
    users = make_population(world, 30, 5)
    rng = random.Random(9)
    for i in range(200):
        task, user = draw_task(world, rng), users[i % len(users)]
        completion = mediocre_completion(task, world, rng, match=0.7)
        by_ids = react(user, task, completion, 300.0, (30, 600, 3600), world, random.Random(i))
        by_words = react(user, task, vocab.read(vocab.text(completion)), 300.0, (30, 600, 3600), world,
                         random.Random(i))
        assert by_words == by_ids


def test_the_demo_tokenizer_makes_every_world_word_one_token(tmp_path: Path) -> None:
    """Trained as ``rtrl demo --engine vllm`` trains it (services/demo/chat_model.py)."""
    from transformers import AutoTokenizer

    from services.demo.chat_model import VOCAB, tokenizer_texts, word_tokens
    from services.stack.tiny_llm import build_tokenizer

    build_tokenizer(tmp_path, 0, VOCAB, tokenizer_texts(make_world(0), 0))
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    split = word_tokens(tokenizer)
    assert set(split) == {*CONTENT_WORDS, ASK_WORD}
    assert {w: ids for w, ids in split.items() if len(ids) != 1} == {}, "after a space"
    first = {w: tokenizer.encode(w, add_special_tokens=False) for w in split}
    assert {w: ids for w, ids in first.items() if len(ids) != 1} == {}, "starting the message"
    assert len({ids[0] for ids in split.values()}) == len(split), "distinct tokens"
