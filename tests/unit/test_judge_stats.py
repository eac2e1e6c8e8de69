"""The judge's statistics against plain references and hand-computed cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from rollback.metrics import classify
from rollback.stats import (
    mixture_radius,
    msprt_p_value,
    proportion_var,
    quantile,
    ratio_mean_var,
    user_sums,
)


def test_mixture_radius_hand_computed() -> None:
    # V=1, tau=1, alpha=0.05: r² = 1·2·(2 ln 20 + ln 2)
    want = math.sqrt(2 * (2 * math.log(20) + math.log(2)))
    assert float(mixture_radius(1.0, 1.0, 0.05)) == pytest.approx(want)
    # Zero variance: zero radius; vectorised over arrays.
    assert mixture_radius(np.array([0.0, 4.0]), 2.0, 0.1).tolist()[0] == 0.0


def test_radius_inverts_the_p_value() -> None:
    # The confidence sequence's edge is exactly where the mSPRT rejects at alpha.
    for var, tau, alpha in [(0.01, 0.03, 0.002), (2.5, 1.0, 0.05), (1e-5, 0.05, 0.01)]:
        r = float(mixture_radius(var, tau, alpha))
        assert float(msprt_p_value(r, var, tau)) == pytest.approx(alpha, rel=1e-9)
        assert float(msprt_p_value(0.99 * r, var, tau)) > alpha


def test_msprt_p_value_hand_computed() -> None:
    # V=1, tau=1, d=3: log Λ = ½ ln ½ + 9/4
    assert float(msprt_p_value(3.0, 1.0, 1.0)) == pytest.approx(math.exp(-(0.5 * math.log(0.5) + 2.25)))
    assert float(msprt_p_value(0.0, 1.0, 1.0)) == 1.0  # Λ < 1 is capped at p = 1
    assert float(msprt_p_value(0.0, 0.0, 1.0)) == 1.0 and float(msprt_p_value(1.0, 0.0, 1.0)) == 0.0


def test_radius_wider_than_fixed_horizon_but_same_order() -> None:
    # The price of looking at every tick: wider than the z interval, not absurdly so.
    var, alpha = 1e-4, 0.01
    z = stats.norm.ppf(1 - alpha / 2) * math.sqrt(var)
    r = float(mixture_radius(var, 10 * math.sqrt(var) / 3, alpha))
    assert z < r < 1.6 * z


def _cluster_var_loop(s: np.ndarray, n: np.ndarray) -> tuple[float, float]:
    m = s.sum() / n.sum()
    g = len(s)
    resid = sum((su - m * nu) ** 2 for su, nu in zip(s, n, strict=True))
    return m, g / (g - 1) * resid / n.sum() ** 2


def test_ratio_mean_var_matches_loop_reference() -> None:
    rng = np.random.default_rng(3)
    n = rng.integers(1, 6, 200).astype(float)
    s = rng.binomial(n.astype(int), 0.6).astype(float)
    m, v = ratio_mean_var(s.sum(), n.sum(), (s * s).sum(), (s * n).sum(), (n * n).sum(), len(s))
    m_ref, v_ref = _cluster_var_loop(s, n)
    assert float(m) == pytest.approx(m_ref) and float(v) == pytest.approx(v_ref)


def test_one_request_per_user_is_the_usual_standard_error() -> None:
    x = np.array([1.0, 4.0, 2.0, 8.0, 5.0])
    m, v = ratio_mean_var(x.sum(), 5, (x * x).sum(), x.sum(), 5, 5)
    assert float(m) == pytest.approx(4.0)
    assert float(v) == pytest.approx(np.var(x, ddof=1) / 5)  # 7.5 / 5
    assert float(v) == pytest.approx(1.5)


def test_clustering_inflates_variance_for_correlated_users() -> None:
    # Two users, each with 50 identical requests, look like 2 observations, not 100.
    s = np.array([50.0, 0.0])
    n = np.array([50.0, 50.0])
    _, v = ratio_mean_var(s.sum(), n.sum(), (s * s).sum(), (s * n).sum(), (n * n).sum(), 2)
    naive = 0.25 / 100
    assert float(v) > 40 * naive


def test_ratio_mean_var_degenerate() -> None:
    m, v = ratio_mean_var(1.0, 1.0, 1.0, 1.0, 1.0, 1)
    assert float(m) == 1.0 and math.isinf(float(v))  # one user: no variance estimate
    m, _ = ratio_mean_var(0.0, 0.0, 0.0, 0.0, 0.0, 0)
    assert math.isnan(float(m))


def test_user_sums_groups_by_user() -> None:
    got = user_sums([("a", 1.0), ("b", 0.0), ("a", 1.0), ("c", 3.0)])
    # users a: S=2,N=2; b: S=0,N=1; c: S=3,N=1
    assert got == (5.0, 4.0, 13.0, 7.0, 6.0, 3)


def test_proportion_var_hand_computed() -> None:
    rate, var = proportion_var(10, 100)
    assert float(rate) == 0.1
    assert float(var) == pytest.approx((10.5 / 101) * (1 - 10.5 / 101) / 100)
    _, var0 = proportion_var(0, 1000)
    assert float(var0) > 0  # zero errors still leave uncertainty
    assert math.isinf(float(proportion_var(0, 0)[1]))


def test_quantile() -> None:
    assert quantile([1.0, 2.0, 3.0, 4.0, 5.0], 0.5) == 3.0
    assert quantile(range(101), 0.99) == pytest.approx(99.0)
    assert math.isnan(quantile([], 0.99))


@pytest.mark.parametrize(("direction", "lo", "hi", "mde", "want"), [
    ("higher_is_better", -0.05, -0.01, 0.03, "worse"),
    ("higher_is_better", 0.01, 0.05, 0.03, "better"),
    ("higher_is_better", -0.02, 0.01, 0.03, "non_inferior"),
    ("higher_is_better", -0.04, 0.01, 0.03, "undecided"),
    ("lower_is_better", 5.0, 20.0, 50.0, "worse"),
    ("lower_is_better", -20.0, -5.0, 50.0, "better"),
    ("lower_is_better", -20.0, 40.0, 50.0, "non_inferior"),
    ("lower_is_better", -20.0, 60.0, 50.0, "undecided"),
])
def test_classify(direction: str, lo: float, hi: float, mde: float, want: str) -> None:
    assert classify(direction, lo, hi, mde) == want  # type: ignore[arg-type]


def test_confidence_sequence_covers_zero_at_every_look() -> None:
    # 2,000 null streams of 100 looks each: the CS at alpha=0.05 should exclude 0 at ANY look
    # in at most ~5% of streams; a fixed-horizon z interval peeked at every look does far worse.
    rng = np.random.default_rng(12)
    x = rng.normal(0.0, 1.0, (2000, 2000))
    n = np.arange(20, 2001, 20)
    means = np.cumsum(x, axis=1)[:, n - 1] / n
    var = 1.0 / n
    cs_miss = (np.abs(means) > mixture_radius(var, 0.1, 0.05)).any(axis=1).mean()
    z_miss = (np.abs(means) > 1.96 * np.sqrt(var)).any(axis=1).mean()
    assert cs_miss <= 0.05
    assert z_miss > 0.2


def test_grouped_sums_matches_the_plain_loop() -> None:
    from rollback.stats import grouped_sums

    rng = np.random.default_rng(5)
    users = rng.integers(0, 40, 500)
    values = rng.normal(size=500)
    want = user_sums((f"u{u}", v) for u, v in zip(users, values, strict=True))
    got = grouped_sums(users, values, np.ones(500), 40)
    assert got[5] == want[5] and got[:5] == pytest.approx(want[:5])
    # A ratio: users whose denominator is zero are left out.
    got = grouped_sums([0, 0, 1, 2], [1.0, 0.0, 0.0, 2.0], [2.0, 1.0, 0.0, 4.0], 3)
    assert got == (3.0, 7.0, 5.0, 11.0, 25.0, 2)
