"""Continuous metrics judged with the pooled extreme tails capped (winsorized): a heavy tail cannot
keep the interval wide, one absurd request cannot move the estimate, and a real shift of
the whole distribution is still seen."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from rollback.judge import judge
from rollback.types import CohortData, Decision, JudgePolicy, MetricEvidence, RequestOutcome

CAPPED = JudgePolicy(min_users=100, max_users=100_000)
PLAIN = JudgePolicy(min_users=100, max_users=100_000, tail_cap_quantile=None)


def _cohort(arm: str, users: int, seed: int, *, pareto: bool = True, shift_ms: float = 0.0,
            outlier_ms: float | None = None) -> CohortData:
    rng = np.random.default_rng(seed)
    out = []
    for u in range(users):
        for _ in range(int(rng.integers(1, 4))):
            lat = 150.0 * (1.0 + rng.pareto(1.5)) if pareto else 400.0 * rng.lognormal(0.0, 0.3)
            out.append(RequestOutcome(user_key=f"{arm}-{u}", reward=0.0, latency_ms=float(lat) + shift_ms,
                                      persistence=None, accepted=None, dissatisfied=0,
                                      completion_kind="edit", tool_calls=0, invalid_tool_calls=0,
                                      completion_tokens=30))
    if outlier_ms is not None:
        out.append(RequestOutcome(user_key=f"{arm}-0", reward=0.0, latency_ms=outlier_ms, persistence=None,
                                  accepted=None, dissatisfied=0, completion_kind="edit", tool_calls=0,
                                  invalid_tool_calls=0, completion_tokens=30))
    return CohortData(arm, tuple(out), requests=len(out), errors=0)  # type: ignore[arg-type]


def _latency(stable: CohortData, canary: CohortData, policy: JudgePolicy) -> MetricEvidence:
    return {e.metric: e for e in judge(stable, canary, policy).metrics}["latency_ms"]


@pytest.mark.parametrize("seed", [11, 12, 13])
def test_a_pareto_tail_narrows_the_interval_of_an_aa_canary(seed: int) -> None:
    stable, canary = _cohort("stable", 3000, seed), _cohort("canary", 3000, seed + 100)
    capped, plain = _latency(stable, canary, CAPPED), _latency(stable, canary, PLAIN)
    assert capped.ci_upper - capped.ci_lower < 0.9 * (plain.ci_upper - plain.ci_lower)
    assert capped.ci_lower < 0 < capped.ci_upper


def test_one_absurd_request_cannot_move_the_estimate() -> None:
    stable = _cohort("stable", 2000, 1, pareto=False)
    calm = _latency(stable, _cohort("canary", 2000, 2, pareto=False), CAPPED)
    wild = _cohort("canary", 2000, 2, pareto=False, outlier_ms=1e9)
    assert abs(_latency(stable, wild, CAPPED).estimate - calm.estimate) < 5.0
    assert _latency(stable, wild, PLAIN).estimate - calm.estimate > 1e4


def test_a_shift_of_the_whole_distribution_still_rolls_back() -> None:
    stable = _cohort("stable", 2000, 3, pareto=False)
    canary = _cohort("canary", 2000, 4, pareto=False, shift_ms=250.0)
    ev = _latency(stable, canary, CAPPED)
    assert ev.status == "worse" and ev.ci_lower > 150.0
    assert judge(stable, canary, CAPPED).decision == Decision.ROLLBACK


def test_the_cap_is_the_same_for_both_arms() -> None:
    """A canary whose tail alone is longer keeps a capped estimate above zero: the cap is the
    pooled quantile, not each arm's own (which would hide a longer tail)."""
    stable = _cohort("stable", 3000, 5, pareto=False)
    canary = _cohort("canary", 3000, 6, pareto=False)
    slow = CohortData("canary", tuple(o if i % 50 else replace(o, latency_ms=20_000.0)
                                      for i, o in enumerate(canary.outcomes)),
                      requests=canary.requests, errors=0)
    assert _latency(stable, slow, CAPPED).estimate > _latency(stable, canary, CAPPED).estimate + 50.0


@pytest.mark.parametrize("q", [1.0, 0.2, -1.0])
def test_a_cap_quantile_outside_its_range_is_refused(q: float) -> None:
    with pytest.raises(ValueError, match="tail_cap_quantile"):
        JudgePolicy(tail_cap_quantile=q)


def test_a_reward_with_a_heavy_lower_tail_gets_a_narrower_interval() -> None:
    """An unbounded reward component (here a penalty linear in a Pareto latency) is a mean
    with near-infinite variance too; both tails are clipped, the lower one here."""
    def with_reward(c: CohortData) -> CohortData:
        return CohortData(c.arm, tuple(replace(o, reward=0.6 - 0.0005 * o.latency_ms) for o in c.outcomes),
                          requests=c.requests, errors=0)
    widths = []
    for policy in (CAPPED, PLAIN):
        ev = {e.metric: e for e in judge(with_reward(_cohort("stable", 3000, 31)),
                                         with_reward(_cohort("canary", 3000, 131)), policy).metrics}["reward"]
        assert ev.ci_lower < 0 < ev.ci_upper
        widths.append(ev.ci_upper - ev.ci_lower)
    assert widths[0] < 0.9 * widths[1]
