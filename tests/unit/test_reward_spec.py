"""Reward spec loading, its error messages, and the optional session terms (additive)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

from ingest.reward.maths import Feedback, compute_reward
from ingest.reward.sessions import SessionWindow
from ingest.reward.spec import RewardSpec, SessionSpec, SpecError, default_spec_text, load_spec, parse_spec
from services.demo.config import demo_spec_text


def test_packaged_default_loads_with_version() -> None:
    spec = load_spec()
    assert spec.version == "default-v1"
    assert spec.persistence.primary_horizon_s in spec.persistence.horizons_s
    assert spec.window_s == max(spec.persistence.horizons_s) + spec.window.grace_s
    assert spec.acceptance.accepted == 0.75 and spec.acceptance.rejected == -0.25


def test_a_file_overrides_the_default(tmp_path: Path) -> None:
    text = default_spec_text().replace('version = "default-v1"', 'version = "team-v7"')
    text = text.replace("primary_horizon_s = 600", "primary_horizon_s = 3600")
    p = tmp_path / "spec.toml"
    p.write_text(text)
    spec = load_spec(p)
    assert spec.version == "team-v7" and spec.persistence.primary_horizon_s == 3600


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[persistence]\nweight = 1", "version"),
        ('version = "v"\n[persistence]\nhorizons_s=[30]\nprimary_horizon_s=600', "primary_horizon_s=600"),
        ('version = "v"\n[latency]\nslo_ms = 0', "latency.slo_ms"),
        ('version = "v"\n[window]\ngrace = 1', "window.grace"),
        ('version = "v"\n[persistence]\nhorizons_s=[]', "persistence.horizons_s"),
        ('version = "has space"', "version"),
        ("version = ", "not valid TOML"),
    ],
)
def test_invalid_specs_name_the_problem(text: str, needle: str) -> None:
    with pytest.raises(SpecError, match="reward spec") as info:
        parse_spec(text, "x.toml")
    assert needle in str(info.value)


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="cannot read reward spec"):
        load_spec(tmp_path / "nope.toml")


# ------------------------------------------------------------------ session terms (additive)
AGENT_TOML = Path(__file__).resolve().parents[2] / "ingest" / "reward" / "specs" / "agent.toml"


def test_a_spec_without_a_session_table_has_no_session_terms() -> None:
    assert load_spec().session is None


def test_the_packaged_agent_spec_is_the_default_plus_documented_session_terms() -> None:
    agent, default = load_spec(AGENT_TOML), load_spec()
    assert agent.version == "agent-v1" and agent.session == SessionSpec()
    assert agent.session is not None
    assert agent.model_copy(update={"version": default.version, "session": None}) == default
    assert agent.session.window == SessionWindow(idle_s=1800.0, max_s=86_400.0, max_turns=10_000)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('version = "v"\n[session]\nidle_s = 0', "session.idle_s"),
        ('version = "v"\n[session]\nper_turn = -1', "session.per_turn"),
        ('version = "v"\n[session]\nturn_cost = 1', "session.turn_cost"),
        ('version = "v"\n[session]\nmax_turns = 0', "session.max_turns"),
    ],
)
def test_invalid_session_terms_name_the_field(text: str, needle: str) -> None:
    with pytest.raises(SpecError, match="reward spec") as info:
        parse_spec(text, "x.toml")
    assert needle in str(info.value)


@dataclass(frozen=True)
class _Served:
    completion_kind: Literal["edit", "question", "empty", "tool_call"]
    latency_ms: float
    invalid_tool_calls: int


def _rewards(spec: RewardSpec, seed: int = 7, n: int = 300) -> str:
    """Per-request rewards of seeded random requests, as the bytes of their JSON."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        fb = Feedback(accepted=rng.choice([True, False, None]),
                      persistence={h: (rng.randrange(50), 50) for h in (30, 600, 3600) if rng.random() < 0.5},
                      dissatisfied=rng.choice([0, 0, 1, 3]))
        served = _Served(rng.choice(["edit", "question", "empty", "tool_call"]), rng.uniform(0, 9000),
                         rng.randrange(6))
        out.append(compute_reward(fb, served, spec))
    return json.dumps(out)


@pytest.mark.parametrize("base", ["default", "demo"])
def test_adding_session_terms_leaves_per_request_rewards_byte_identical(base: str) -> None:
    text = default_spec_text() if base == "default" else demo_spec_text(default_spec_text())
    with_session = text + "\n[session]\ncompleted = 2.0\nper_turn = 0.5\nidle_s = 60\n"
    before, after = parse_spec(text), parse_spec(with_session)
    assert before.session is None and after.session is not None
    assert _rewards(after) == _rewards(before)
    assert _rewards(load_spec(AGENT_TOML)) == _rewards(load_spec())
