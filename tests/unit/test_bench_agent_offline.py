"""`rtrl bench agent-offline`: a session is worked, assembled and credited by the real session
stage (one record per turn, each turn's credit as the session stage gives it), a chat answer of
the Hugging Face model is read as the harness reads it, and a tiny run prints its rows."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.agent_offline import (
    ChatAgent,
    SessionRun,
    TokenAgent,
    TurnRec,
    agent_figures,
    loop_config,
    main,
    parser,
    work,
)
from ingest.reward.spec import agent_spec_text, parse_spec
from services.demo.config import demo_spec_text
from services.settings.demo import SimulatorSettings
from services.sim.agent import make_agent_world
from services.sim.chat_world import CONTENT_WORDS, ChatVocab
from services.sim.users import make_population
from trainer.policy import TinyConfig, TinyTransformer
from trainer.tokens import EOS

pytestmark = pytest.mark.unit


def test_each_turn_is_credited_once_with_its_sessions_return() -> None:
    spec = parse_spec(demo_spec_text(agent_spec_text()), "agent demo spec")
    assert spec.session is not None
    aw = make_agent_world(3)
    users = make_population(aw.world, 20, 3)
    runs = work(TokenAgent(TinyTransformer(TinyConfig())), aw, users, 12, spec, SimulatorSettings(), 5)
    outcome = tomllib.loads(demo_spec_text(agent_spec_text()))["session"]
    for r in runs:
        assert r.end in {"completed", "abandoned", "handed_back"}
        assert len(r.records) == r.turns == len(r.moves) >= 1
        assert len({x.session_id for x in r.records}) == 1
        # turns without an invalid call share one credit; an invalid call costs its turn
        clean = [x.reward for x, m in zip(r.records, r.moves, strict=True) if not m.startswith("invalid")]
        assert len(set(clean)) <= 1
        if clean:
            assert clean[0] <= outcome[r.end] + outcome["persisted_edits"]
        broken = [x.reward for x, m in zip(r.records, r.moves, strict=True) if m.startswith("invalid")]
        assert all(b < clean[0] for b in broken) if clean else True
    f = agent_figures(runs)
    assert f.completion == pytest.approx(sum(r.end == "completed" for r in runs) / len(runs))
    assert f.invalid_sessions == pytest.approx(sum(r.invalid_calls > 0 for r in runs) / len(runs))
    assert sum(f.moves.values()) == pytest.approx(1.0)


def test_figures_count_sessions_once_and_turns_of_completed_ones() -> None:
    def recs(*rewards: float) -> tuple[TurnRec, ...]:
        return tuple(TurnRec([1], [2], [0.0], r, "s") for r in rewards)

    runs = [SessionRun("completed", 4, 0, 1, recs(1, 1, 1, 1), ("step", "question", "step", "accepted")),
            SessionRun("abandoned", 2, 2, 0, recs(-1, -1), ("invalid-not_json", "invalid-not_json")),
            SessionRun("completed", 6, 1, 0, recs(0, 0, 0, 0, 0, 0), ("miss",) * 6)]
    f = agent_figures(runs)
    assert f.completion == pytest.approx(2 / 3)
    assert f.turns_completed == pytest.approx(5.0)  # (4 + 6) / 2: abandoned sessions' turns left out
    assert f.invalid_sessions == pytest.approx(2 / 3)
    assert f.questions == pytest.approx(1 / 12)
    assert f.reward == pytest.approx(2 / 12)
    assert f.moves["miss"] == pytest.approx(6 / 12) and f.moves["invalid-not_json"] == pytest.approx(2 / 12)


def test_a_tiny_run_prints_the_bootstrap_and_each_increment(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--increments", "1", "--sessions", "60", "--eval-sessions", "20", "--corpus", "300",
                 "--users", "20"]) == 0
    out = capsys.readouterr().out
    assert "bootstrap: completion=" in out and "increment 1: completion=" in out
    assert "last vs bootstrap: completion" in out


@dataclass
class Answers:
    """A policy that answers with the ids it is given (the model under test is the tokenizer)."""

    ids: list[int]
    eos: set[int]

    def sample(self, prompt: list[int], max_new_tokens: int, temperature: float = 1.0,
               seed: int | None = None) -> tuple[list[int], list[float]]:
        self.prompt = prompt
        return self.ids[:max_new_tokens], [-0.5] * min(len(self.ids), max_new_tokens)


def test_a_chat_answer_is_read_as_the_harness_reads_it(tmp_path: Path) -> None:
    from services.demo.chat_model import VOCAB, tokenizer_texts
    from services.stack.tiny_llm import build_tokenizer

    aw = make_agent_world(4)
    vocab = ChatVocab(aw.world)
    tok = build_tokenizer(tmp_path, 4, VOCAB, tokenizer_texts(aw.world, 4))
    words = " ".join(CONTENT_WORDS[:3])
    answer = tok.encode(" " + words, add_special_tokens=False)
    sim, prompt = SimulatorSettings(), vocab.read(" ".join(CONTENT_WORDS[3:6]))
    eos = tok.eos_token_id
    ended = ChatAgent(Answers([*answer, eos], {eos}), tok, vocab).act(prompt, sim, 0)
    assert ended.read == [*vocab.read(words), EOS]  # the model ended its answer: EOS, as finish_reason stop
    assert ended.tokens[-1] == tok.eos_token_id and len(ended.logps) == len(ended.tokens)
    rendered = tok.apply_chat_template([{"role": "user", "content": vocab.message(prompt)}],
                                       add_generation_prompt=True, tokenize=False)
    assert tok.decode(ended.prompt) == rendered  # the engine's prompt: the chat template's
    cut = ChatAgent(Answers(answer * 30, {eos}), tok, vocab).act(prompt, sim, 0)
    assert len(cut.tokens) == sim.max_tokens and EOS not in cut.read  # cut at max_tokens: no EOS


def test_the_hf_engine_takes_the_lora_demos_trainer_settings_unless_flags_say_otherwise() -> None:
    from services.demo.engine import LORA_AGENT_LR

    hf = loop_config(parser().parse_args(["--engine", "hf"]))
    builtin = loop_config(parser().parse_args([]))
    assert hf.lr == LORA_AGENT_LR and hf.warmup_steps == 0 and builtin.lr != LORA_AGENT_LR
    assert hf.band is not None and builtin.band is not None and hf.band.target_kl == builtin.band.target_kl
    assert hf.band.max_length_change is None and builtin.band.max_length_change is not None
    assert loop_config(parser().parse_args(["--engine", "hf", "--lr", "0.004"])).lr == 0.004
    assert loop_config(parser().parse_args(["--engine", "hf", "--kl-band", "off"])).band is None
