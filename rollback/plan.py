"""How many canary users each primary metric needs before the judge can promote, and when
the canary will have them at the traffic it gets.

The judge promotes once every primary metric's always-valid interval on canary − stable
clears its margin (the MDE) on the harmful side (rollback/judge.py). If the true difference
is 0 and the estimate has variance ``V``, the bound clears the margin with probability
``power`` once ``r(V) + z_power·√V ≤ margin``, where ``r`` is the confidence sequence's
radius (:func:`rollback.stats.mixture_radius`). A user-clustered mean's variance falls as
1/users, so from the variance ``V`` seen at ``n`` canary users the plan projects ``V·n/m``
at ``m`` users and finds the least ``m`` that clears the margin. Before the canary has
``min_users`` users, stable's variance per user stands in for it: at a canary weight ``w``
the difference of two arms with per-user variance σ² has variance σ²/(m·(1 − w)), taken
at the last step's weight.

Assumptions (docs/judge.md, "Planning"): the canary's per-user variance is stable's (true
for a candidate that is no worse, the case a plan is for), users keep arriving at the rate
seen so far, and each weight step lasts ``bake_s`` (the last one until the decision).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from statistics import NormalDist
from typing import Any

from rollback.stats import mixture_radius
from rollback.types import JudgePolicy, MetricEvidence, Verdict

POWER = 0.8
"""The chance, for a candidate exactly as good as stable, that a metric is decided by the
planned users."""


def clears(var: float, margin: float, tau: float, alpha: float, power: float = POWER) -> bool:
    """Whether an estimate with variance ``var`` clears ``margin`` with ``power`` when the
    true difference is 0 (``alpha``: the two-sided level of the confidence sequence)."""
    z = NormalDist().inv_cdf(power)
    return float(mixture_radius(var, tau, alpha)) + z * math.sqrt(var) <= margin


def clearing_variance(margin: float, tau: float, alpha: float, power: float = POWER) -> float:
    """The largest variance of the estimate that still clears ``margin`` (bisection on the
    log scale: the radius grows with the variance)."""
    if margin <= 0:
        raise ValueError(f"margin must be > 0, got {margin}")
    lo, hi = margin * margin * 1e-12, margin * margin
    while clears(hi, margin, tau, alpha, power):  # at V = margin² the radius alone is over it
        hi *= 2.0
    for _ in range(100):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if clears(mid, margin, tau, alpha, power) else (lo, mid)
        if hi / lo < 1.0 + 1e-9:
            break
    return lo


def users_needed(var_per_user: float, margin: float, tau: float, alpha: float,
                 power: float = POWER) -> int:
    """Canary users at which an estimate of variance ``var_per_user / users`` clears ``margin``."""
    if not var_per_user > 0:
        return 1
    return max(1, math.ceil(var_per_user / clearing_variance(margin, tau, alpha, power)))


def time_to_users(needed: float, have: float, users_per_s: float, steps: Sequence[float], step: int,
                  step_elapsed_s: float, bake_s: float) -> float | None:
    """Seconds until the canary has ``needed`` users, new users arriving at ``users_per_s``
    and the canary taking ``steps[i]`` of them on step ``i``, each step lasting ``bake_s``
    and the last one until the end. None: no users arrive."""
    if have >= needed:
        return 0.0
    if users_per_s <= 0 or not steps:
        return None
    t, n = 0.0, float(have)
    first = min(max(0, step), len(steps) - 1)
    for i in range(first, len(steps)):
        rate = users_per_s * steps[i]
        if i == len(steps) - 1:  # the last step lasts until the decision
            return t + (needed - n) / rate
        span = max(0.0, bake_s - (step_elapsed_s if i == first else 0.0))
        if n + rate * span >= needed:
            return t + (needed - n) / rate
        n, t = n + rate * span, t + span
    return None


@dataclass(frozen=True)
class MetricPlan:
    metric: str
    margin: float
    """The non-inferiority margin (the metric's MDE)."""
    users: int
    """Canary users so far."""
    needed: int | None
    """Canary users at which the metric is decided with ``POWER`` (None: no variance seen yet)."""
    eta_s: float | None
    """Seconds from now to ``needed`` at the traffic so far (0: met; None: unknown)."""
    decided: bool
    """The judge already finds the metric non-inferior (or better)."""


@dataclass(frozen=True)
class CanaryPlan:
    metrics: tuple[MetricPlan, ...]
    users_per_min: float
    """New users per minute over both arms, since the canary started."""
    eta_s: float | None
    """Seconds until every primary metric has its users (None: unknown)."""
    budget_left_s: float
    warning: str = ""
    """Set when the plan does not fit the budget: what it needs and what would fix it."""

    def to_doc(self) -> dict[str, Any]:
        return asdict(self)


def _per_user_var(e: MetricEvidence, last_weight: float) -> float | None:
    if e.status != "insufficient" and e.n_canary > 0 and math.isfinite(e.var_canary + e.var_stable):
        return (e.var_canary + e.var_stable) * e.n_canary
    if e.n_stable > 1 and math.isfinite(e.var_stable) and e.var_stable > 0:
        return e.var_stable * e.n_stable / (1.0 - last_weight)
    return None


def plan_canary(verdict: Verdict, policy: JudgePolicy, steps: Sequence[float], step: int,
                step_elapsed_s: float, elapsed_s: float, bake_s: float,
                power: float = POWER) -> CanaryPlan:
    """The plan for a canary judged ``verdict``, ``elapsed_s`` after it started (module doc)."""
    alpha = min(0.5, 2 * policy.alpha_per_test())
    rate = (verdict.users_stable + verdict.users_canary) / elapsed_s if elapsed_s > 0 else 0.0
    primary = {s.name: s for s in policy.metrics if s.primary}
    plans = []
    for e in verdict.metrics:
        if e.metric not in primary:
            continue
        decided = e.status in ("non_inferior", "better")
        s2 = _per_user_var(e, steps[-1] if steps else 0.0)
        needed = None if s2 is None else max(policy.min_users, users_needed(
            s2, e.mde, policy.mixture_scale * e.mde, alpha, power))
        if decided:
            needed = min(needed or e.n_canary, e.n_canary)
        eta = None if needed is None else time_to_users(needed, e.n_canary, rate, steps, step,
                                                        step_elapsed_s, bake_s)
        plans.append(MetricPlan(e.metric, e.mde, e.n_canary, needed, eta, decided))
    etas = [p.eta_s for p in plans]
    eta = None if not plans or any(x is None for x in etas) else max(x for x in etas if x is not None)
    left = max(0.0, policy.max_duration_s - elapsed_s)
    return CanaryPlan(tuple(plans), rate * 60.0, eta, left, _warning(plans, eta, left, rate, policy))


def _warning(plans: list[MetricPlan], eta: float | None, left: float, rate: float,
             policy: JudgePolicy) -> str:
    over_users = [p for p in plans if p.needed is not None and p.needed > policy.max_users]
    if eta is not None and eta <= left and not over_users:
        return ""
    known = [p for p in plans if p.needed is not None]
    slow = max(known, key=lambda p: math.inf if p.eta_s is None else p.eta_s, default=None)
    if slow is None or slow.needed is None:
        return ""
    when = "never at the traffic so far" if slow.eta_s is None else f"in about {slow.eta_s / 60:,.0f} min"
    limit = (f"the sample budget of {policy.max_users:,} users per arm" if over_users
             else f"the {left / 60:,.0f} min left of the time budget")
    return (f"{slow.metric} needs about {slow.needed:,} canary users to be decided ({when}, at "
            f"{rate * 60:,.1f} new users/min), beyond {limit}: more traffic, a wider margin "
            f"(its MDE, {slow.margin:g}) or larger canary steps would fit it.")
