"""The judge's statistics: small pure functions, vectorised with numpy so the benchmark can run
thousands of canaries through exactly the code the judge uses.

Unit of analysis: the user. A metric is a ratio of per-user sums, mean = ΣS_u / ΣN_u (a
per-request mean), and its variance is the cluster-robust (delta-method) variance over users,
so several correlated requests from one user do not count as independent evidence.

Sequential test: the mixture sequential probability ratio test (mSPRT, Johari et al. 2017)
with a normal mixture N(0, τ²) over the difference δ = canary − stable, applied to the
asymptotically normal estimate δ̂ with variance V. Its likelihood ratio is

    Λ(δ̂; V, τ) = sqrt(V / (V + τ²)) · exp(τ² δ̂² / (2 V (V + τ²)))

and, by Ville's inequality, P(Λ ever exceeds 1/α under δ = 0) ≤ α, however often one looks.
Inverting it gives the confidence sequence δ̂ ± r(V) with

    r(V)² = V (1 + V/τ²) (2 log(1/α) + log(1 + τ²/V)),

the same boundary as the asymptotic confidence sequence of Waudby-Smith et al. (2021) with
ρ² = τ²/σ². The running minimum of 1/Λ is the always-valid p-value.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from numpy.typing import ArrayLike, NDArray

Arr = NDArray[np.float64]


def mixture_radius(var: ArrayLike, tau: ArrayLike, alpha: float) -> Arr:
    """Half-width of the two-sided (1 − alpha) always-valid confidence sequence for a normal
    estimate with variance ``var`` and mixture standard deviation ``tau``."""
    v = np.asarray(var, dtype=np.float64)
    t2 = np.asarray(tau, dtype=np.float64) ** 2
    with np.errstate(divide="ignore", invalid="ignore"):
        r2 = v * (1.0 + v / t2) * (2.0 * np.log(1.0 / alpha) + np.log1p(t2 / v))
    return np.sqrt(np.where(v > 0, r2, 0.0))


def msprt_p_value(estimate: ArrayLike, var: ArrayLike, tau: ArrayLike) -> Arr:
    """1/Λ for "no difference" at one look (take the running minimum for the always-valid p)."""
    d = np.asarray(estimate, dtype=np.float64)
    v = np.asarray(var, dtype=np.float64)
    t2 = np.asarray(tau, dtype=np.float64) ** 2
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        log_lr = 0.5 * np.log(v / (v + t2)) + t2 * d * d / (2.0 * v * (v + t2))
        p = np.exp(-np.clip(log_lr, 0.0, 700.0))
    return np.where(v > 0, p, np.where(d == 0, 1.0, 0.0))


def ratio_mean_var(
    s: ArrayLike, n: ArrayLike, s2: ArrayLike, sn: ArrayLike, n2: ArrayLike, users: ArrayLike
) -> tuple[Arr, Arr]:
    """Mean ΣS/ΣN and its cluster-robust variance from sums over users of S_u, N_u, S_u²,
    S_u·N_u, N_u² (``users`` = number of users with N_u > 0).

    var = G/(G−1) · Σ(S_u − m N_u)² / (ΣN)², expanded so that running sums suffice.
    """
    s_, n_, g = (np.asarray(x, dtype=np.float64) for x in (s, n, users))
    with np.errstate(divide="ignore", invalid="ignore"):
        m = s_ / n_
        resid = np.asarray(s2) - 2.0 * m * np.asarray(sn) + m * m * np.asarray(n2)
        var = (g / (g - 1.0)) * np.maximum(resid, 0.0) / (n_ * n_)
    m = np.where(n_ > 0, m, np.nan)
    var = np.where(g > 1, var, np.inf)
    return m, var


def user_sums(pairs: Iterable[tuple[str, float]]) -> tuple[float, float, float, float, float, int]:
    """(ΣS, ΣN, ΣS², ΣSN, ΣN², users) from (user_key, value) pairs, one per request."""
    per_user: dict[str, list[float]] = {}
    for user, value in pairs:
        acc = per_user.setdefault(user, [0.0, 0.0])
        acc[0] += value
        acc[1] += 1.0
    s = np.array([a[0] for a in per_user.values()], dtype=np.float64)
    n = np.array([a[1] for a in per_user.values()], dtype=np.float64)
    return (float(s.sum()), float(n.sum()), float((s * s).sum()), float((s * n).sum()),
            float((n * n).sum()), len(per_user))


def grouped_sums(user: ArrayLike, num: ArrayLike, den: ArrayLike, users: int
                 ) -> tuple[float, float, float, float, float, int]:
    """Vectorised ``user_sums``: request i belongs to user index ``user[i]`` and adds ``num[i]``
    to S_u and ``den[i]`` to N_u (1 for a plain mean, the denominator for a ratio metric).
    Users whose N_u is 0 do not count."""
    u = np.asarray(user, dtype=np.int64)
    s = np.bincount(u, weights=np.asarray(num, dtype=np.float64), minlength=users)
    n = np.bincount(u, weights=np.asarray(den, dtype=np.float64), minlength=users)
    keep = n > 0
    s, n = s[keep], n[keep]
    return (float(s.sum()), float(n.sum()), float((s * s).sum()), float((s * n).sum()),
            float((n * n).sum()), int(keep.sum()))


def proportion_var(successes: ArrayLike, trials: ArrayLike) -> tuple[Arr, Arr]:
    """Rate and binomial variance of the rate (for counts without a user breakdown, e.g. the
    gateway's error counts). A Jeffreys-style ½ pseudo-count keeps zero-count arms from
    claiming zero variance."""
    x = np.asarray(successes, dtype=np.float64)
    n = np.asarray(trials, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        rate = np.where(n > 0, x / n, np.nan)
        shrunk = (x + 0.5) / (n + 1.0)
        var = np.where(n > 0, shrunk * (1.0 - shrunk) / n, np.inf)
    return rate, var


def quantile(values: Iterable[float], q: float) -> float:
    """Empirical quantile (linear interpolation, numpy's default); nan for no values."""
    arr = np.fromiter(values, dtype=np.float64)
    return float(np.quantile(arr, q)) if arr.size else float("nan")
