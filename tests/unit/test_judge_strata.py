"""The judge under real traffic shapes: time strata, capped heavy users, clustered error rates and
guardrails that wait for data — each against a plain reference or a hand computation."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import integrate

from rollback.judge import judge
from rollback.metrics import Strata
from rollback.stats import (
    Cells,
    cap_factor,
    cmh_weights,
    design_effect,
    exceedance_log_lr,
    ratio_mean_var,
    strata_difference,
    stratified_difference,
)
from rollback.types import (
    CohortData,
    Decision,
    DetectorPolicy,
    ErrorCount,
    GuardrailPolicy,
    JudgePolicy,
    MetricSpec,
    RequestOutcome,
)

pytestmark = pytest.mark.unit


def _cells(rows: list[tuple[int, int, float]], den: list[float] | None = None) -> Cells:
    """(user, stratum, value) per request."""
    u = np.array([r[0] for r in rows], dtype=np.int64)
    return Cells(u, np.array([r[1] for r in rows], dtype=np.int64), np.array([r[2] for r in rows]),
                 np.array(den if den is not None else [1.0] * len(rows)), int(u.max()) + 1)


# --- the stratified estimate ------------------------------------------------------------------
def test_stratified_estimate_equals_a_hand_computation() -> None:
    # Stratum 0: stable users 0, 1 (means 1, 0 -> 0.5); canary users 0, 1 (1, 1 -> 1.0). Diff 0.5.
    # Stratum 1: stable users 2, 3, 4 (0, 0, 0 -> 0); canary users 2, 3, 4 (1, 0, 0 -> 1/3).
    stable = _cells([(0, 0, 1.0), (1, 0, 0.0), (2, 1, 0.0), (3, 1, 0.0), (4, 1, 0.0)])
    canary = _cells([(0, 0, 1.0), (1, 0, 1.0), (2, 1, 1.0), (3, 1, 0.0), (4, 1, 0.0)])
    got = stratified_difference(stable, canary, strata=2)
    w0, w1 = 2 * 2 / 4, 3 * 3 / 6  # Cochran–Mantel–Haenszel weights: 1 and 1.5
    assert got.estimate == pytest.approx((w0 * 0.5 + w1 * (1 / 3)) / (w0 + w1))  # = 0.4
    assert got.estimate == pytest.approx(0.4)
    assert got.stable_mean == pytest.approx((w0 * 0.5 + w1 * 0.0) / 2.5)
    assert got.canary_mean == pytest.approx((w0 * 1.0 + w1 * (1 / 3)) / 2.5)
    # Variance, by hand: stable stratum 0 residuals ±0.5 over N=2 with G/(G-1)=2; stratum 1 all 0.
    v_stable = (w0 / 2.5) ** 2 * 2 * (0.25 + 0.25) / 4
    # canary stratum 0 residuals 0; stratum 1 residuals 2/3, -1/3, -1/3 over N=3 with 3/2.
    v_canary = (w1 / 2.5) ** 2 * 1.5 * (4 / 9 + 1 / 9 + 1 / 9) / 9
    assert got.var_stable == pytest.approx(v_stable)
    assert got.var_canary == pytest.approx(v_canary)
    assert (got.users_stable, got.users_canary, got.strata) == (5, 5, 2)


def _capped_cells(c: Cells, cap: float | None) -> dict[tuple[int, int], list[float]]:
    """{(user, stratum): [S, N]} with each user's total N capped at ``cap``."""
    cell: dict[tuple[int, int], list[float]] = {}
    for u, s, x, d in zip(c.user.tolist(), c.stratum.tolist(), c.num.tolist(), c.den.tolist(), strict=True):
        acc = cell.setdefault((u, s), [0.0, 0.0])
        acc[0] += x
        acc[1] += d
    totals: dict[int, float] = {}
    for (u, _), (_, n) in cell.items():
        totals[u] = totals.get(u, 0.0) + n
    for (u, _), acc in cell.items():
        f = 1.0 if cap is None or totals[u] <= cap else cap / totals[u]
        acc[0], acc[1] = acc[0] * f, acc[1] * f
    return {k: v for k, v in cell.items() if v[1] > 0}


def _stratum(arm: dict[tuple[int, int], list[float]], s: int) -> tuple[float, float, int]:
    sums = [v for (_, t), v in arm.items() if t == s]
    return sum(v[0] for v in sums), sum(v[1] for v in sums), len(sums)


def _reference(stable: Cells, canary: Cells, strata: int, cap: float | None) -> tuple[float, float]:
    """Plain-Python stratified difference and its user-clustered variance."""
    arms = [_capped_cells(c, cap) for c in (stable, canary)]
    w = {}
    for s in range(strata):
        gs, gc = _stratum(arms[0], s)[2], _stratum(arms[1], s)[2]
        w[s] = gs * gc / (gs + gc) if gs >= 2 and gc >= 2 else 0.0
    total = sum(w.values())
    est, var = 0.0, 0.0
    for sign, arm in ((-1, arms[0]), (1, arms[1])):
        influence: dict[int, float] = {}
        for s in (s for s in range(strata) if w[s] > 0):
            ssum, nsum, g = _stratum(arm, s)
            m = ssum / nsum
            est += sign * w[s] / total * m
            scale = w[s] / total * math.sqrt(g / (g - 1)) / nsum
            for (u, t), (x, n) in arm.items():
                if t == s:
                    influence[u] = influence.get(u, 0.0) + scale * (x - m * n)
        var += sum(v * v for v in influence.values())
    return est, var


@pytest.mark.parametrize(("seed", "cap"), [(0, None), (1, 3.0), (2, 10.0)])
def test_stratified_difference_matches_a_plain_reference(seed: int, cap: float | None) -> None:
    rng = np.random.default_rng(seed)
    def arm() -> Cells:
        n = 400
        user = rng.integers(0, 60, n)  # users span strata, some are heavy
        return Cells(user, rng.integers(0, 5, n), rng.random(n).round(2), np.ones(n), 60)
    stable, canary = arm(), arm()
    got = stratified_difference(stable, canary, 5, cap)
    est, var = _reference(stable, canary, 5, cap)
    assert got.estimate == pytest.approx(est)
    assert got.var_stable + got.var_canary == pytest.approx(var)


def test_one_stratum_is_the_plain_cluster_robust_comparison() -> None:
    rng = np.random.default_rng(3)
    n = 300
    stable = Cells(rng.integers(0, 50, n), np.zeros(n, dtype=np.int64), rng.random(n), np.ones(n), 50)
    got = stratified_difference(stable, stable, 1)
    s = np.bincount(stable.user, weights=stable.num)
    k = np.bincount(stable.user)
    keep = k > 0
    s, k = s[keep], k[keep].astype(float)
    m, v = ratio_mean_var(s.sum(), k.sum(), (s * s).sum(), (s * k).sum(), (k * k).sum(), int(keep.sum()))
    assert got.stable_mean == pytest.approx(float(m))
    assert got.var_stable == pytest.approx(float(v))
    assert got.estimate == pytest.approx(0.0)


def test_strata_sums_agree_with_the_cell_path_when_each_user_is_in_one_stratum() -> None:
    rng = np.random.default_rng(4)
    arms_cells, arms_sums = [], []
    for _ in range(2):
        users = 90
        stratum_of_user = rng.integers(0, 4, users)
        n_req = rng.integers(1, 15, users)
        user = np.repeat(np.arange(users), n_req)
        values = rng.random(user.size)
        arms_cells.append(Cells(user, stratum_of_user[user], values, np.ones(user.size), users))
        f = cap_factor(n_req, 5.0)
        s = np.bincount(user, weights=values) * f
        n = n_req * f
        sums = tuple(np.bincount(stratum_of_user, weights=x, minlength=4)
                     for x in (s, n, s * s, s * n, n * n, np.ones(users)))
        arms_sums.append(sums)
    got = stratified_difference(arms_cells[0], arms_cells[1], 4, 5.0)
    m_s, m_c, v_s, v_c = strata_difference(arms_sums[0], arms_sums[1])
    assert (float(m_s), float(m_c)) == pytest.approx((got.stable_mean, got.canary_mean))
    assert (float(v_s), float(v_c)) == pytest.approx((got.var_stable, got.var_canary))


def test_cmh_weights_and_cap() -> None:
    assert cmh_weights([2, 1, 10, 0], [2, 5, 10, 3]).tolist() == [1.0, 0.0, 5.0, 0.0]
    assert cap_factor([1, 10, 40], 10.0).tolist() == [1.0, 1.0, 0.25]
    assert cap_factor([1, 10, 40], None).tolist() == [1.0, 1.0, 1.0]


def test_strata_split_on_weight_changes_and_time() -> None:
    times = np.array([100.0, 150.0, 399.0, 400.0, 1000.0, 1100.0])
    s = Strata(times, boundaries=(100.0, 400.0), width_s=600.0)
    # [100, 400) step 1; [400, 700) bucket 0 step 2; [700, 1300) bucket 1 step 2.
    assert s.of(times).tolist() == [0, 0, 0, 1, 2, 2]
    assert Strata(np.zeros(3), (), 600.0).count == 1


# --- guardrail statistics ---------------------------------------------------------------------
@pytest.mark.parametrize(("k", "n", "q0"), [(0, 50, 0.01), (3, 200, 0.01), (12, 300, 0.01), (4, 4, 0.05),
                                             (7, 60, 0.05), (2.5, 40.0, 0.05)])
def test_exceedance_martingale_matches_numerical_integration(k: float, n: float, q0: float) -> None:
    def lr(q: float) -> float:
        return (q / q0) ** k * ((1 - q) / (1 - q0)) ** (n - k)
    uniform = integrate.quad(lambda q: lr(q) / (1 - q0), q0, 1, limit=200)[0]
    b = 1 / q0
    beta = integrate.quad(lambda q: lr(q) * b * (1 - q) ** (b - 1) / (1 - q0) ** b, q0, 1, limit=200)[0]
    assert float(exceedance_log_lr(k, n, q0)) == pytest.approx(math.log(0.5 * uniform + 0.5 * beta), rel=1e-6)


def test_exceedance_martingale_holds_its_level_when_checked_every_request() -> None:
    # Exactly at the ceiling (q = q0) and checked after every request, it crosses 1/alpha in at most
    # about alpha of the runs (Ville's inequality).
    rng = np.random.default_rng(5)
    runs, n, alpha = 2000, 1500, 0.05
    k = np.cumsum(rng.random((runs, n)) < 0.01, axis=1)
    lr = exceedance_log_lr(k, np.arange(1, n + 1), 0.01)
    crossed = (lr >= math.log(1 / alpha)).any(axis=1).mean()
    assert crossed <= alpha


def test_design_effect() -> None:
    assert design_effect(0, 100, 0.5) == 1.0
    assert design_effect(10, 100, 0.09 / 100 * 4) == pytest.approx(4.0)
    assert design_effect(10, 100, 0.0) == 1.0  # never below 1


# --- verdicts under real traffic shapes -------------------------------------------------------
RAMP = ((0.0, 0.01), (600.0, 0.05), (1200.0, 0.25), (1800.0, 0.5))


def _ramp_traffic(seed: int, *, latency_drift: float = 0.0, persistence_cycle: float = 0.0,
                  minutes: int = 90, per_minute: int = 60) -> tuple[CohortData, CohortData]:
    """Users arrive every minute; the canary's share follows RAMP; each user makes 1-4 requests in
    the minute they arrive. Latency drifts up by ``latency_drift`` over the run and persistence
    follows a cycle, both shared by the arms (an A/A canary)."""
    rng = np.random.default_rng(seed)
    arms: dict[str, list[RequestOutcome]] = {"stable": [], "canary": []}
    for minute in range(minutes):
        t = minute * 60.0
        weight = [w for start, w in RAMP if start <= t][-1]
        drift = 1.0 + latency_drift * minute / minutes
        p = 0.6 + persistence_cycle * math.cos(math.pi * minute / minutes)
        for i in range(per_minute):
            arm = "canary" if rng.random() < weight else "stable"
            user = f"{arm}-{minute}-{i}"
            p_user = rng.beta(8 * p, 8 * (1 - p))
            for _ in range(1 + rng.integers(0, 4)):
                arms[arm].append(RequestOutcome(
                    user_key=user, reward=0.0, latency_ms=float(400 * drift * rng.lognormal(0, 0.5)),
                    persistence=float(rng.random() < p_user), ts=t + rng.random() * 60))
    return CohortData("stable", tuple(arms["stable"])), CohortData("canary", tuple(arms["canary"]))


DRIFT_POLICY = JudgePolicy(
    metrics=(MetricSpec("persistence", 0.03), MetricSpec("latency_ms", 50.0, "lower_is_better")),
    detectors=DetectorPolicy(enabled=()), min_users=200, stratum_s=600.0)


def _without_time(c: CohortData) -> CohortData:
    return CohortData(c.arm, tuple(RequestOutcome(o.user_key, o.reward, o.latency_ms, o.persistence,
                                                  ts=0.0) for o in c.outcomes))


@pytest.mark.parametrize("shape", [{"latency_drift": 0.3}, {"persistence_cycle": 0.08}])
def test_a_shared_drift_under_the_ramp_does_not_roll_back(shape: dict[str, float]) -> None:
    stable, canary = _ramp_traffic(11, **shape)
    boundaries = [start for start, _ in RAMP]
    verdict = judge(stable, canary, DRIFT_POLICY, boundaries=boundaries)
    assert verdict.decision != Decision.ROLLBACK, verdict.reasons
    # The same data compared as whole-window means (no time information) is fooled by the drift:
    # the test above could fail.
    pooled = judge(_without_time(stable), _without_time(canary), DRIFT_POLICY)
    assert pooled.decision == Decision.ROLLBACK, pooled.reasons


def _cohort(arm: str, users: int, requests_each: int = 3,
            latency: float = 300.0) -> tuple[RequestOutcome, ...]:
    return tuple(RequestOutcome(user_key=f"{arm}{u}", reward=0.0, latency_ms=latency, persistence=0.6,
                                ts=float(u))
                 for u in range(users) for _ in range(requests_each))


ERR_POLICY = JudgePolicy(metrics=(MetricSpec("error_rate", 0.01, "lower_is_better", primary=False),
                                  MetricSpec("persistence", 0.03)),
                         detectors=DetectorPolicy(enabled=()), min_users=200)


def test_one_users_burst_of_errors_does_not_roll_back() -> None:
    stable = CohortData("stable", _cohort("s", 1000), requests=3000, errors=3,
                        user_errors=tuple(ErrorCount(f"s{u}", float(u), 1) for u in (7, 99, 500)))
    # One canary user retries a failing request 25 times: 25 errors from one user.
    canary = CohortData("canary", _cohort("c", 1000), requests=3025, errors=25,
                        user_errors=(ErrorCount("c42", 42.0, 25),))
    v = judge(stable, canary, ERR_POLICY)
    assert v.decision != Decision.ROLLBACK, v.reasons
    # Counted as independent requests (no user known), the same burst is a confident regression.
    anonymous = CohortData("canary", canary.outcomes, requests=3025, errors=25)
    assert judge(stable, anonymous, ERR_POLICY).decision == Decision.ROLLBACK


def test_errors_spread_over_many_users_still_roll_back() -> None:
    stable = CohortData("stable", _cohort("s", 1000), requests=3000, errors=3,
                        user_errors=tuple(ErrorCount(f"s{u}", float(u), 1) for u in (7, 99, 500)))
    errs = tuple(ErrorCount(f"c{u}", float(u), 1) for u in range(0, 1000, 10))  # 100 users, 3.2%
    canary = CohortData("canary", _cohort("c", 1000), requests=3100, errors=100, user_errors=errs)
    v = judge(stable, canary, ERR_POLICY)
    assert v.decision == Decision.ROLLBACK
    assert any("error rate" in r.lower() for r in v.reasons)


def test_a_canary_failing_every_request_rolls_back_on_the_first_look() -> None:
    stable = CohortData("stable", _cohort("s", 30), requests=90)
    canary = CohortData("canary", (), requests=6, errors=6,
                        user_errors=tuple(ErrorCount(f"c{u}", 0.0, 1) for u in range(6)))
    v = judge(stable, canary, JudgePolicy())
    assert v.decision == Decision.ROLLBACK
    assert v.reasons[0].startswith("Guardrail: canary error rate 100.00%")


def test_a_canary_slower_than_the_ceiling_on_every_request_rolls_back_on_the_first_look() -> None:
    policy = JudgePolicy(guardrails=GuardrailPolicy(max_p99_latency_ms=2_000))
    stable = CohortData("stable", _cohort("s", 30))
    canary = CohortData("canary", _cohort("c", 2, requests_each=2, latency=5_000.0))
    v = judge(stable, canary, policy)
    assert v.decision == Decision.ROLLBACK
    assert "p99 latency" in v.reasons[0]


def test_the_p99_guardrail_waits_for_its_quantile_to_be_stable() -> None:
    # 300 canary requests, 4 over the ceiling: the empirical p99 is over it, but 4 of 300 is no
    # evidence that more than 1% are.
    policy = JudgePolicy(guardrails=GuardrailPolicy(max_p99_latency_ms=2_000))
    stable = CohortData("stable", _cohort("s", 300))
    slow = tuple(RequestOutcome(f"c{u}", 0.0, 9_000.0 if u < 4 else 300.0, 0.6, ts=float(u))
                 for u in range(300))
    v = judge(stable, CohortData("canary", slow), policy)
    p99 = {g.name: g for g in v.guardrails}["p99_latency_ms"]
    assert p99.canary_value > 2_000 and not p99.tripped
    # 15% of the canary's requests over the ceiling is.
    slow = tuple(RequestOutcome(f"c{u}", 0.0, 9_000.0 if u % 7 == 0 else 300.0, 0.6, ts=float(u))
                 for u in range(300))
    assert {g.name: g for g in judge(stable, CohortData("canary", slow), policy).guardrails}[
        "p99_latency_ms"].tripped
