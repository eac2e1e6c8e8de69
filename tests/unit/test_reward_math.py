"""Reward maths: hand-computed cases and a plain reference over random inputs."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

import pytest

from ingest.reward.maths import (
    COMPONENTS,
    Feedback,
    compute_reward,
    latency_penalty,
    persistence_ratio,
    tool_call_penalty,
)
from ingest.reward.spec import NoEditSpec, RewardSpec, load_spec

SPEC = load_spec()  # default-v1: accepted .75, rejected -.25, slo 2000 ms w .1 cap 1,
# dissatisfied .5 max 1, invalid .25 max 1, no-edit 0 / 0, default 0, primary horizon 600
PENALISED = SPEC.model_copy(update={"no_edit": NoEditSpec(question=0.3, empty=0.2)})


@dataclass(frozen=True)
class S:
    completion_kind: Literal["edit", "question", "empty"] = "edit"
    latency_ms: float = 1000.0
    invalid_tool_calls: int = 0


def test_accepted_edit_with_persistence_at_primary_horizon() -> None:
    fb = Feedback(accepted=True, persistence={30: (100, 100), 600: (80, 100), 3600: (10, 100)})
    reward, comps = compute_reward(fb, S(), SPEC)
    assert comps["acceptance"] == 0.75
    assert comps["persistence"] == pytest.approx(0.8)
    assert reward == pytest.approx(1.55)
    assert set(comps) == set(COMPONENTS)


def test_rejected_edit_ignores_persistence_and_pays_latency_and_tools() -> None:
    fb = Feedback(accepted=False, persistence={600: (50, 100)})
    # latency 3000 ms: over = 0.5 -> -0.05 ; 2 invalid calls -> -0.5
    reward, comps = compute_reward(fb, S(latency_ms=3000, invalid_tool_calls=2), SPEC)
    assert comps == {"persistence": 0.0, "acceptance": -0.25, "dissatisfied": 0.0,
                     "latency": pytest.approx(-0.05), "invalid_tool_calls": -0.5, "no_edit": 0.0,
                     "default": 0.0}
    assert reward == pytest.approx(-0.8)


def test_no_feedback_gets_default_plus_served_terms() -> None:
    reward, comps = compute_reward(Feedback(), S(latency_ms=10_000, invalid_tool_calls=9), SPEC)
    # latency capped at 1 -> -0.1; tools capped at -1.0
    assert comps["default"] == 0.0 and comps["latency"] == pytest.approx(-0.1)
    assert comps["invalid_tool_calls"] == -1.0
    assert reward == pytest.approx(-1.1)


def test_question_has_no_edit_terms_even_if_edit_events_came() -> None:
    fb = Feedback(accepted=True, persistence={600: (100, 100)})
    reward, comps = compute_reward(fb, S(completion_kind="question"), SPEC)
    assert comps["acceptance"] == 0.0 and comps["persistence"] == 0.0
    assert reward == 0.0  # defaulted: nothing that counts for a question came


def test_no_edit_penalty_applies_to_questions_and_empties_whatever_the_feedback() -> None:
    q, q_comps = compute_reward(Feedback(), S(completion_kind="question"), PENALISED)
    e, e_comps = compute_reward(Feedback(dissatisfied=1), S(completion_kind="empty"), PENALISED)
    edit, edit_comps = compute_reward(Feedback(accepted=True), S(), PENALISED)
    assert q_comps["no_edit"] == -0.3 and q == pytest.approx(-0.3)
    assert e_comps["no_edit"] == -0.2 and e == pytest.approx(-0.7)  # with the dissatisfied -0.5
    assert edit_comps["no_edit"] == 0.0 and edit == pytest.approx(0.75)


def test_dissatisfied_question_is_penalised_once() -> None:
    reward, comps = compute_reward(Feedback(dissatisfied=3), S(completion_kind="empty"), SPEC)
    assert comps["dissatisfied"] == -0.5 and reward == -0.5


def test_persistence_falls_back_to_nearest_horizon() -> None:
    assert persistence_ratio({30: (9, 10), 3600: (1, 10)}, 600) == pytest.approx(0.9)
    assert persistence_ratio({3600: (1, 10)}, 600) == pytest.approx(0.1)
    assert persistence_ratio({}, 600) is None
    assert persistence_ratio({600: (0, 0)}, 600) is None


def test_latency_and_tool_terms_hand_computed() -> None:
    assert latency_penalty(2000, 2000, 0.1, 1.0) == 0.0
    assert latency_penalty(5000, 2000, 0.2, 1.0) == pytest.approx(-0.2)  # over 1.5, capped 1
    assert latency_penalty(2500, 2000, 0.2, 1.0) == pytest.approx(-0.05)
    assert tool_call_penalty(3, 0.25, 1.0) == -0.75
    assert tool_call_penalty(0, 0.25, 1.0) == 0.0


def _reference(fb: Feedback, s: S, spec: RewardSpec) -> float:
    """Plain restatement of the spec, written independently of the module."""
    total = _reference_served_terms(s, spec)
    counts = fb.dissatisfied > 0 or (
        s.completion_kind == "edit" and (fb.accepted is not None or len(fb.persistence) > 0))
    if not counts:
        return total + spec.window.default_reward
    total -= spec.dissatisfied.penalty * min(fb.dissatisfied, spec.dissatisfied.max_count)
    if s.completion_kind != "edit":
        return total
    return _reference_edit_terms(total, fb, spec)


def _reference_served_terms(s: S, spec: RewardSpec) -> float:
    """Latency, invalid tool calls and the no-edit penalty: paid whatever the feedback."""
    total = 0.0
    lat = s.latency_ms - spec.latency.slo_ms
    if lat > 0:
        total -= spec.latency.weight * min(spec.latency.cap, lat / spec.latency.slo_ms)
    total -= min(spec.tool_calls.max_penalty, spec.tool_calls.invalid_penalty * s.invalid_tool_calls)
    if s.completion_kind == "question":
        total -= spec.no_edit.question
    if s.completion_kind == "empty":
        total -= spec.no_edit.empty
    return total


def _reference_edit_terms(total: float, fb: Feedback, spec: RewardSpec) -> float:
    """``total`` plus acceptance, then persistence at the usable horizon nearest 600 s (none
    after a rejection)."""
    if fb.accepted is True:
        total += spec.acceptance.accepted
    if fb.accepted is False:
        total += spec.acceptance.rejected
        return total
    best = None
    for h in sorted(fb.persistence):
        r, i = fb.persistence[h]
        if i == 0:
            continue
        if best is None or abs(h - 600) < abs(best - 600):
            best = h
    if best is not None:
        r, i = fb.persistence[best]
        total += spec.persistence.weight * min(1.0, r / i)
    return total


@pytest.mark.parametrize("spec", [SPEC, PENALISED], ids=["default", "no-edit penalties"])
def test_matches_plain_reference_on_random_inputs(spec: RewardSpec) -> None:
    rng = random.Random(7)
    for _ in range(2000):
        pers = {}
        for h in (30, 600, 3600):
            if rng.random() < 0.5:
                ins = rng.randint(0, 50)
                pers[h] = (rng.randint(0, ins), ins)
        fb = Feedback(accepted=rng.choice([None, True, False]), persistence=pers,
                      dissatisfied=rng.choice([0, 0, 1, 2]))
        s = S(completion_kind=rng.choice(["edit", "edit", "question", "empty"]),
              latency_ms=rng.uniform(0, 8000), invalid_tool_calls=rng.choice([0, 0, 1, 5]))
        reward, comps = compute_reward(fb, s, spec)
        assert reward == pytest.approx(_reference(fb, s, spec), abs=1e-12)
        assert reward == pytest.approx(sum(comps.values()), abs=1e-12)
