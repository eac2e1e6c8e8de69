"""``rtrl demo --agent`` without a stack: its spec, corpus, environment, bad candidates (built
for real from a tiny champion) and their order, and the flags it refuses."""

from __future__ import annotations

import random
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest

from deployer.adapters.memory import InMemoryRegistry
from ingest.contracts.registry import CANDIDATE, Tag
from ingest.reward.spec import agent_spec_text, default_spec_text, parse_spec
from services.demo import run as demo
from services.demo.candidates import make_bad_candidate
from services.demo.config import DEMO_AGENT_INVALID_CALL, demo_spec_text, demo_trainer_env, write_corpus
from services.demo.inject import BASELINE_REWARDS, BadCandidateInjector, BadCandidates, bad_kinds
from services.settings.demo import DemoSettings
from services.sim.agent import AgentSession, make_agent_world, read_action
from services.sim.users import make_population, make_world
from trainer import corpus as corpus_file
from trainer.policy import TinyTransformer, load_policy

pytestmark = pytest.mark.unit
QUIET = {"phase": "idle"}


def test_the_agent_spec_has_the_defaults_tables_the_demos_windows_and_session_terms() -> None:
    spec = parse_spec(demo_spec_text(agent_spec_text()))
    one_shot = parse_spec(demo_spec_text(default_spec_text()))
    assert spec.session is not None and one_shot.session is None
    assert spec.session.invalid_tool_call == DEMO_AGENT_INVALID_CALL
    assert spec.window == one_shot.window and spec.latency == one_shot.latency
    assert spec.version.startswith("demo-agent-") and one_shot.version.startswith("demo-v3-")


def test_the_agent_demo_steps_smaller_than_the_one_shot_demo() -> None:
    agent, one_shot = demo_trainer_env(agent=True), demo_trainer_env()
    assert float(agent["RTRL_TRAINER__BAND__TARGET"]) < float(one_shot["RTRL_TRAINER__BAND__TARGET"])
    assert float(agent["RTRL_TRAINER__BAND__LOW"]) < float(agent["RTRL_TRAINER__BAND__TARGET"]) \
        < float(agent["RTRL_TRAINER__BAND__HIGH"])


def test_the_agent_corpus_is_turns_of_agent_sessions(tmp_path: Path) -> None:
    pairs = corpus_file.read_corpus(write_corpus(tmp_path / "c.jsonl", 0, n=200, agent=True))
    aw = make_agent_world(0)
    assert len(pairs) == 200 and {read_action(c, aw).kind for _, c in pairs} == {"call", "answer"}


def test_bad_kinds() -> None:
    assert bad_kinds(DemoSettings(agent=True)) == ("malformed-tool", "stalling")
    assert bad_kinds(DemoSettings(agent=True, bad_candidate="stalling")) == ("stalling",)
    assert bad_kinds(DemoSettings()) == ("reward-hacked",)
    assert bad_kinds(DemoSettings(agent=True, bad_candidate="none")) == ("none",)


def _policy(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "policy.json").write_text('{"kind": "tiny-transformer"}')
    return path


def test_bad_candidates_go_in_one_after_the_other(tmp_path: Path) -> None:
    reg = InMemoryRegistry(tmp_path / "registry")
    reg.set_alias("champion", reg.register(None, _policy(tmp_path / "v1"), {Tag.KIND: "bootstrap"}))
    built: list[str] = []

    def build(kind: str, champion: Path, out: Path, world: Any, seed: int) -> Path:
        built.append(kind)
        return _policy(out)

    settings = DemoSettings(agent=True)
    bad = BadCandidates([BadCandidateInjector(settings, tmp_path / kind, make_agent_world(0), lambda: reg,
                                              nullcontext(), build=build, kind=kind)
                         for kind in bad_kinds(settings)])
    bad.step(QUIET, {}, BASELINE_REWARDS)
    assert built == ["malformed-tool"] and reg.alias_version(CANDIDATE) == "2" and bad.version == "2"
    bad.step(QUIET, {}, BASELINE_REWARDS)
    assert built == ["malformed-tool"], "the second waits for the first's verdict"
    decided = {"2": "rolled_back"}
    reg.set_tags("2", {Tag.CANARY_OUTCOME: "rolled_back"})
    bad.step(QUIET, decided, BASELINE_REWARDS)
    assert built == ["malformed-tool", "stalling"] and reg.alias_version(CANDIDATE) == "3"
    assert reg.get_tags("3")[Tag.KIND] == "stalling" and not bad.done(decided)
    decided["3"] = "rolled_back"
    assert bad.done(decided) and bad.tries == ["2", "3"]
    assert bad.kinds() == {"2": "malformed-tool", "3": "stalling"}


@pytest.mark.parametrize("kind", ["stalling", "malformed-tool"])
def test_the_agents_bad_candidates_do_what_they_are_named_for(kind: str, tmp_path: Path) -> None:
    """Built for real from a tiny champion: sampled in sessions, the stalling agent asks and the
    malformed one calls tools without arguments, and users abandon their sessions."""
    aw = make_agent_world(0)
    champion = TinyTransformer().save(tmp_path / "champion")
    out = load_policy(make_bad_candidate(kind, champion, tmp_path / "bad", aw, seed=1))
    rng = random.Random(2)
    users = make_population(aw.world, 20, 2)
    actions, ends = [], []
    for _ in range(20):
        session = AgentSession(aw, rng.choice(users), rng.choice(aw.tasks))
        while session.end is None:
            tokens, _ = out.sample(session.prompt(rng), 8, 1.0, seed=rng.randrange(2**31))
            actions.append(read_action(tokens, aw))
            session.step(tokens, 100.0, (3600,), rng)
        ends.append(session.end)
    share = sum((a.kind == "question") if kind == "stalling" else (a.invalid_reason == "schema_mismatch")
                for a in actions) / len(actions)
    assert share > 0.8 and ends.count("abandoned") >= 18


def test_an_agents_bad_candidate_needs_the_agent_world(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="agent world"):
        make_bad_candidate("stalling", tmp_path, tmp_path / "o", make_world(0))
    with pytest.raises(ValueError, match="stalling"):
        make_bad_candidate("reward-hacked", tmp_path, tmp_path / "o", make_agent_world(0))


@pytest.mark.parametrize(("argv", "needle"), [
    (["--agent", "--bad-candidate", "reward-hacked"], "one-shot users"),
    (["--bad-candidate", "stalling"], "add --agent"),
])
def test_the_flags_the_agent_demo_refuses(argv: list[str], needle: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        demo.main(argv)
    assert exc.value.code == 2 and needle in capsys.readouterr().err
