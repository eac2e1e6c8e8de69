"""`rtrl bench agent-offline`: a session is worked, assembled and credited by the real session
stage (one record per turn, each turn's credit as the session stage gives it), and a tiny run
prints its rows."""

from __future__ import annotations

import tomllib

import pytest

from bench.agent_offline import SessionRun, TurnRec, agent_figures, main, work
from ingest.reward.spec import agent_spec_text, parse_spec
from services.demo.config import demo_spec_text
from services.settings.demo import SimulatorSettings
from services.sim.agent import make_agent_world
from services.sim.users import make_population
from trainer.policy import TinyConfig, TinyTransformer

pytestmark = pytest.mark.unit


def test_each_turn_is_credited_once_with_its_sessions_return() -> None:
    spec = parse_spec(demo_spec_text(agent_spec_text()), "agent demo spec")
    assert spec.session is not None
    aw = make_agent_world(3)
    users = make_population(aw.world, 20, 3)
    runs = work(TinyTransformer(TinyConfig()), aw, users, 12, spec, SimulatorSettings(), 5)
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
