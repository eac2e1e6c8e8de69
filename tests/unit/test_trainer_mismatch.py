"""The train-inference mismatch: the pure figures against a plain reference, the gate's bound,
and an increment whose behaviour log-probabilities came from another model."""

from __future__ import annotations

import json
import math
import random

import pytest

from trainer.gate import GateConfig, HeldoutScore, evaluate
from trainer.mismatch import Mismatch, mismatch

pytestmark = pytest.mark.unit


def reference(trainer: list[list[float]], engine: list[list[float]],
              cap: float) -> tuple[int, float, float, float]:
    diffs = [t - e for tr, er in zip(trainer, engine, strict=True) for t, e in zip(tr, er, strict=True)]
    absolute = sorted(abs(d) for d in diffs)
    n = len(absolute)
    k = 0
    while (k + 1) / n < 0.99:  # nearest rank: the smallest k+1 with (k+1)/n >= 0.99
        k += 1
    return n, sum(absolute) / n, absolute[k], sum(1 for d in diffs if math.exp(d) > cap) / n


def test_hand_case() -> None:
    got = mismatch([[-1.0, -2.0], [-0.5]], [[-1.0, -2.5], [-1.5]], truncate=2.0)
    # differences 0, 0.5, 1.0; exp(1.0) > 2 only for the last
    assert got == Mismatch(3, pytest.approx(0.5), 1.0, pytest.approx(1 / 3))  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", range(5))
def test_matches_the_reference(seed: int) -> None:
    rng = random.Random(seed)
    rows = [rng.randrange(1, 40) for _ in range(rng.randrange(1, 30))]
    trainer = [[-rng.expovariate(1.0) for _ in range(n)] for n in rows]
    engine = [[t + rng.gauss(0, 0.3) for t in tr] for tr in trainer]
    got = mismatch(trainer, engine, truncate=1.5)
    n, mean, p99, trunc = reference(trainer, engine, 1.5)
    assert (got.tokens, got.p99_abs) == (n, p99)
    assert got.mean_abs == pytest.approx(mean) and got.truncated_share == pytest.approx(trunc)


def test_empty_non_finite_and_ragged_input() -> None:
    assert mismatch([], [], 2.0) == Mismatch(0, 0.0, 0.0, 0.0)
    inf = mismatch([[-1.0, -1.0]], [[-1.0, -math.inf]], 2.0)
    assert inf.p99_abs == math.inf and inf.mean_abs == math.inf and inf.truncated_share == 0.5
    with pytest.raises(ValueError, match="2 trainer and 1 engine"):
        mismatch([[-1.0, -1.0]], [[-1.0]], 2.0)


def scores() -> list[HeldoutScore]:
    return [HeldoutScore(1.0, [-1.0], [-1.0], [-1.0])] * 30


@pytest.mark.parametrize("found, bound, failed, note", [
    (Mismatch(500, 0.01, 0.05, 0.0), 0.1, False, False),
    (Mismatch(500, 0.8, 3.0, 0.3), 0.1, True, False),
    (Mismatch(500, math.inf, math.inf, 0.5), 0.1, True, False),
    (Mismatch(500, 0.8, 3.0, 0.3), 0.0, False, False),  # 0: not checked
    (Mismatch(0, 0.0, 0.0, 0.0), 0.1, False, True),     # nothing the parent served
])
def test_the_gate_bounds_the_parents_mismatch(found: Mismatch, bound: float, failed: bool,
                                              note: bool) -> None:
    gate = evaluate(scores(), [0.1], GateConfig(max_mismatch=bound, min_kl=0.0), found)
    assert gate.passed is not failed
    assert any("train-inference mismatch" in r for r in gate.reasons) is failed
    assert any("mismatch not measured" in n for n in gate.notes) is note
    assert "train-inference" in json.loads(gate.reasons_json())["reasons"][0] if failed else True
