"""Statistical checks of the sequential judge on bounded simulations (fixed seeds).

Each bound is loose enough not to flake and tight enough to fail if the test were broken:
the same data judged by a fixed-horizon z interval at every tick breaks the false-rollback
bound, and a judge without power fails the detection bound.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from bench.judge import SimConfig, bench_policy, ours_by_tick, ratio_by_tick, simulate_arm
from rollback.types import DetectorPolicy, MetricSpec

CFG = SimConfig(ticks=20, users_per_tick=100)


def _runs(canaries: int, seed: int, shift: float) -> list[tuple[object, object]]:
    rng = np.random.default_rng(seed)
    return [(simulate_arm(rng, CFG, 50), simulate_arm(rng, CFG, 50, persistence_shift=shift))
            for _ in range(canaries // 50)]


@pytest.fixture(scope="module")
def aa() -> list[tuple[object, object]]:
    return _runs(300, seed=2024, shift=0.0)


def test_aa_false_rollbacks_stay_under_alpha_when_checked_every_tick(aa: list) -> None:
    # One metric at alpha 0.05: the judge may falsely roll back at most ~5% of A/A canaries.
    policy = replace(bench_policy(CFG.budget), alpha=0.05,
                     metrics=(MetricSpec("persistence", 0.03),), detectors=DetectorPolicy(enabled=()))
    rolled = np.concatenate([(ours_by_tick(s, c, CFG, policy)[0] == -1).any(axis=1) for s, c in aa])
    assert rolled.mean() <= 0.08

    # The same data through a z interval (one-sided 5%) peeked at every tick: far more.
    naive = []
    for s, c in aa:
        m_s, v_s = ratio_by_tick(s, "persistence", CFG)
        m_c, v_c = ratio_by_tick(c, "persistence", CFG)
        naive.append(((m_c - m_s) + 1.645 * np.sqrt(v_s + v_c) < 0).any(axis=1))
    assert np.concatenate(naive).mean() > 0.12


def test_aa_with_the_full_policy_rarely_rolls_back(aa: list) -> None:
    policy = bench_policy(CFG.budget)
    rolled = np.concatenate([(ours_by_tick(s, c, CFG, policy)[0] == -1).any(axis=1) for s, c in aa])
    assert rolled.mean() <= 0.03


def test_detects_twice_the_mde_early() -> None:
    policy = bench_policy(CFG.budget)
    first_codes, first_ticks = [], []
    for s, c in _runs(150, seed=99, shift=-0.06):
        code, tick = ours_by_tick(s, c, CFG, policy)
        first_ticks.append(tick)
        first_codes.append(code[np.arange(len(tick)), np.maximum(tick, 0)])
    ticks, codes = np.concatenate(first_ticks), np.concatenate(first_codes)
    detected = (ticks >= 0) & (codes == -1)
    assert detected.mean() >= 0.9
    assert np.median((ticks[detected] + 1) * CFG.users_per_tick) <= CFG.budget / 2
