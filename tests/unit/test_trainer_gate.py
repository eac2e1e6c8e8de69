"""The offline gate's estimators against hand-computed values and plain references, and
its verdicts on clearly good, clearly broken and far-off-policy candidates."""

from __future__ import annotations

import json
import math
import random

import pytest

from trainer.gate import (
    GateConfig,
    HeldoutScore,
    evaluate,
    kl_parent_candidate,
    sequence_weight,
    snips_estimate,
)


def test_sequence_weight_hand_cases() -> None:
    assert sequence_weight([], [], 2.0) == 1.0
    # ratios e^0.5 and e^-0.5 -> geometric mean 1
    assert sequence_weight([-1.0, -2.0], [-1.5, -1.5], 2.0) == pytest.approx(1.0)
    # ratio e^3 is truncated at 2, ratio 1 stays: sqrt(2 * 1)
    assert sequence_weight([0.0, -1.0], [-3.0, -1.0], 2.0) == pytest.approx(math.sqrt(2))


def test_snips_hand_case_and_reference() -> None:
    est, lo, hi, ess = snips_estimate([1.0, 1.0], [0.0, 2.0], z=1.0)
    assert est == pytest.approx(1.0)
    # se = sqrt(1*1 + 1*1) / 2
    assert (lo, hi) == pytest.approx((1 - math.sqrt(2) / 2, 1 + math.sqrt(2) / 2))
    assert ess == pytest.approx(1.0)
    rng = random.Random(0)
    w = [rng.uniform(0.1, 2) for _ in range(50)]
    r = [rng.uniform(-1, 1) for _ in range(50)]
    ref = sum(wi * ri for wi, ri in zip(w, r, strict=True)) / sum(w)
    assert snips_estimate(w, r, 1.96)[0] == pytest.approx(ref)
    assert snips_estimate(w, r, 1.96)[3] == pytest.approx(sum(w) ** 2 / (50 * sum(x * x for x in w)))
    assert math.isnan(snips_estimate([], [], 1.96)[0])


def test_kl_is_zero_for_identical_policies_and_matches_a_reference() -> None:
    lp = [-1.0, -2.0, -0.1]
    assert kl_parent_candidate(lp, lp, lp, 2.0) == 0.0
    parent, cand, beh = [-1.0, -2.0], [-1.5, -1.0], [-1.0, -2.5]
    ref = 0.0
    for p, c, b in zip(parent, cand, beh, strict=True):
        w = min(math.exp(p - b), 2.0)
        ref += w * (math.exp(c - p) - 1 - (c - p))
    assert kl_parent_candidate(parent, cand, beh, 2.0) == pytest.approx(ref)
    assert kl_parent_candidate(parent, cand, beh, 2.0) > 0


def scores(n: int, shift: float, seed: int = 0) -> list[HeldoutScore]:
    """Held-out records whose candidate log-probs differ from behavior by ``shift`` per token."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        beh = [-rng.uniform(0.5, 3) for _ in range(5)]
        out.append(HeldoutScore(rng.uniform(-1, 1), beh, [b + shift for b in beh], beh))
    return out


def test_unchanged_candidate_passes_when_movement_is_not_required() -> None:
    result = evaluate(scores(100, 0.0), [0.5, 0.4], GateConfig(min_kl=0.0))
    assert result.passed, result.reasons
    assert result.figures["ess"] == pytest.approx(1.0)
    assert result.figures["kl_parent"] == pytest.approx(0.0)
    assert result.figures["estimate"] == pytest.approx(result.figures["baseline_reward"])
    assert json.loads(result.reasons_json())["reasons"] == []
    assert result.result == "pass"


@pytest.mark.parametrize(("shift", "min_kl", "passed"), [
    (0.0, 1e-3, False),   # training kept no step: the candidate is its parent
    (0.01, 1e-3, False),  # moved, but less than the floor (KL about 0.5 * 5 * 0.01**2)
    (0.1, 1e-3, True),
    (0.01, 1e-5, True),
])
def test_a_candidate_that_did_not_move_fails(shift: float, min_kl: float, passed: bool) -> None:
    result = evaluate(scores(100, shift), [0.5], GateConfig(min_kl=min_kl))
    assert result.passed is passed, (result.reasons, result.figures)
    assert any("training kept no step" in r for r in result.reasons) is not passed


def test_nan_and_exploding_losses_fail() -> None:
    broken = scores(30, 0.0)
    broken[3] = HeldoutScore(0.0, [-1.0], [float("nan")], [-1.0])
    r = evaluate(broken, [0.1], GateConfig())
    assert not r.passed and "non-finite candidate" in r.reasons[0]
    assert not evaluate(scores(30, 0.0), [0.1, float("inf")], GateConfig()).passed
    assert not evaluate(scores(30, 0.0), [0.1, 1e9], GateConfig()).passed


def test_far_moved_candidate_fails_on_kl() -> None:
    r = evaluate(scores(100, 2.0), [0.1], GateConfig(max_kl=1.0))
    assert not r.passed
    assert any("KL to parent" in x for x in r.reasons)


def test_low_ess_fails_and_small_samples_only_note() -> None:
    rng = random.Random(3)
    s = []
    for i in range(60):  # a few records get all the weight
        beh = [-2.0] * 4
        cand = [b + (3.0 if i < 2 else -3.0) for b in beh]
        s.append(HeldoutScore(rng.uniform(-1, 1), beh, cand, beh))
    cfg = GateConfig(max_kl=1e9, min_ess=0.5)
    r = evaluate(s, [0.1], cfg)
    assert not r.passed and any("effective sample size" in x for x in r.reasons)
    small = evaluate(s[:10], [0.1], cfg)
    assert small.passed and "estimate not used" in small.notes[0]


def test_clear_regression_fails() -> None:
    # the candidate puts its weight on the low-reward records
    s = []
    for i in range(200):
        good = i % 2 == 0
        beh = [-1.0] * 3
        cand = [b + (-0.6 if good else 0.6) for b in beh]
        s.append(HeldoutScore(1.0 if good else -1.0, beh, cand, beh))
    r = evaluate(s, [0.1], GateConfig(max_kl=1e9, min_ess=0.0, max_regression=0.05))
    assert not r.passed and any("clearly below logged" in x for x in r.reasons)
    assert r.figures["ci_high"] < r.figures["baseline_reward"]
