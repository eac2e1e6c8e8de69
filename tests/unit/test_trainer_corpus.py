"""The bootstrap corpus format and the default corpus generator."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.settings.model import Settings
from services.sim.users import bootstrap_corpus
from services.wiring.trainer import increment_config
from trainer.corpus import read_corpus, write_corpus
from trainer.tokens import BOS, EOS, VOCAB_SIZE


def test_round_trip_and_default_corpus_shape(tmp_path: Path) -> None:
    pairs = bootstrap_corpus(50, seed=0)
    assert len(pairs) == 50
    assert all(p[0] == BOS and c[-1] == EOS for p, c in pairs)
    assert pairs == bootstrap_corpus(50, seed=0)  # deterministic
    path = tmp_path / "c.jsonl"
    assert write_corpus(path, pairs) == 50
    assert read_corpus(path, VOCAB_SIZE) == pairs


def test_malformed_lines_name_their_line(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    path.write_text('# comment\n\n{"prompt": [0, 3], "completion": [4, 1]}\n'
                    '{"prompt": [0], "completion": []}\n')
    with pytest.raises(ValueError, match=r"c\.jsonl:4"):
        read_corpus(path)
    path.write_text('{"prompt": [0, 3], "completion": [99]}\n')
    with pytest.raises(ValueError, match="outside the vocabulary"):
        read_corpus(path, VOCAB_SIZE)
    path.write_text("# nothing\n")
    with pytest.raises(ValueError, match="empty"):
        read_corpus(path)


def test_increment_config_follows_settings() -> None:
    s = Settings()
    cfg = increment_config(s)
    assert cfg.topic == s.topics.rewards
    assert cfg.loop.objective.clip_high == s.trainer.clip_high
    assert cfg.gate.max_kl == s.trainer.gate.max_kl
    assert cfg.group_size == s.trainer.group_size
