"""The rollback judge: one pure call per tick, ``judge(stable, canary, policy, state)``.

Order of precedence in a verdict:
1. a guardrail tripped (error rate or p99 latency over its ceiling) -> rollback, at once;
2. a metric is confidently worse on the canary (its always-valid confidence sequence on
   canary − stable excludes 0 in the bad direction) -> rollback;
3. a reward-hacking detector found confident behaviour drift -> rollback;
4. every primary metric is confidently no worse than −MDE (non-inferior), no detector is
   holding, each arm has at least ``min_users`` users -> promote;
5. the sample or time budget is spent -> inconclusive (abort, never promote);
6. otherwise -> continue.
See docs/judge.md for the method and how to tune it.
"""

from __future__ import annotations

import math

from rollback.detectors import run_detectors
from rollback.metrics import (
    LABELS,
    METRICS,
    IndexedArm,
    Sums,
    arm_stats,
    compare,
    fmt_delta,
    fmt_value,
    index_arm,
    sums_for,
)
from rollback.stats import proportion_var, quantile
from rollback.types import (
    CohortData,
    Decision,
    GuardrailResult,
    JudgePolicy,
    JudgeState,
    MetricEvidence,
    MetricSpec,
    Verdict,
)


def judge(
    stable: CohortData,
    canary: CohortData,
    policy: JudgePolicy | None = None,
    state: JudgeState | None = None,
    *,
    elapsed_s: float = 0.0,
) -> Verdict:
    """Judge the canary against stable over the same window.

    ``state`` is the ``Verdict.state`` of the previous tick (None on the first); ``elapsed_s``
    is the time since the canary started, for the time budget.
    """
    policy = policy or JudgePolicy()
    st: JudgeState = dict(state or {})
    st["ticks"] = st.get("ticks", 0.0) + 1.0
    users_s, users_c = stable.users(), canary.users()

    guards = guardrails(stable, canary, policy)
    alpha_t = policy.alpha_per_test()
    arms = index_arm(stable.outcomes), index_arm(canary.outcomes)
    evidence = tuple(_metric(spec, stable, canary, arms, policy, alpha_t, st) for spec in policy.metrics)
    detectors = run_detectors(*arms, policy, alpha_t, st)

    reasons: list[str] = []
    level = 1.0 - 2.0 * alpha_t
    tripped = [g for g in guards if g.tripped]
    worse = [e for e in evidence if e.status == "worse"]
    fired = [d for d in detectors if d.fired]
    if tripped or worse or fired:
        reasons += [_guard_reason(g) for g in tripped]
        reasons += [d.explanation for d in fired]
        reasons += [f"{describe(e, level)}: confidently worse on the canary." for e in worse]
        return Verdict(Decision.ROLLBACK, tuple(reasons), evidence, guards, detectors, users_s, users_c, st)

    primary = [e for e in evidence if _is_primary(e, policy.metrics)]
    holding = [d for d in detectors if d.holding]
    enough = min(users_s, users_c) >= policy.min_users
    non_inferior = all(e.status in ("non_inferior", "better") for e in primary)
    improved = any(e.status == "better" for e in primary)
    if enough and non_inferior and not holding and (improved or not policy.require_improvement):
        reasons.append("Every primary metric is, with confidence, no worse than its minimum "
                       "detectable effect; no guardrail or reward-hacking detector fired.")
        reasons += [f"{describe(e, level)}." for e in primary]
        return Verdict(Decision.PROMOTE, tuple(reasons), evidence, guards, detectors, users_s, users_c, st)

    out_of_users = min(users_s, users_c) >= policy.max_users
    out_of_time = elapsed_s >= policy.max_duration_s
    waiting = [e for e in primary if e.status not in ("non_inferior", "better")]
    reasons += [d.explanation for d in holding]
    if not enough:
        reasons.append(f"Waiting for {policy.min_users} users per arm "
                       f"(stable {users_s}, canary {users_c}).")
    else:
        reasons += [f"{describe(e, level)}: not yet shown to be within "
                    f"{fmt_delta(e.metric, e.mde, sign=False)} of stable." for e in waiting]
    if out_of_users or out_of_time:
        budget = (f"the sample budget of {policy.max_users} users per arm" if out_of_users
                  else f"the time budget of {policy.max_duration_s / 3600:.1f} h")
        reasons.insert(0, f"Inconclusive: {budget} is spent without a decision; "
                          "abort the canary rather than promote it.")
        return Verdict(Decision.INCONCLUSIVE, tuple(reasons), evidence, guards, detectors,
                       users_s, users_c, st)
    return Verdict(Decision.CONTINUE, tuple(reasons), evidence, guards, detectors, users_s, users_c, st)


def guardrails(stable: CohortData, canary: CohortData, policy: JudgePolicy) -> tuple[GuardrailResult, ...]:
    """Absolute ceilings. A guardrail trips when the canary has served ``min_requests``, its value
    is over the ceiling and over stable's (a ceiling both arms break is not the canary's fault)."""
    g = policy.guardrails
    enough = canary.request_count() >= g.min_requests
    err_c = canary.error_count() / max(1, canary.request_count())
    err_s = stable.error_count() / max(1, stable.request_count())
    p99_c = quantile((o.latency_ms for o in canary.outcomes), 0.99)
    p99_s = quantile((o.latency_ms for o in stable.outcomes), 0.99)
    p99_trip = enough and math.isfinite(p99_c) and p99_c > g.max_p99_latency_ms and not p99_s >= p99_c
    return (
        GuardrailResult("error_rate", err_c, err_s, g.max_error_rate,
                        enough and err_c > g.max_error_rate and err_c > err_s),
        GuardrailResult("p99_latency_ms", p99_c, p99_s, g.max_p99_latency_ms, p99_trip),
    )


def _metric(spec: MetricSpec, stable: CohortData, canary: CohortData,
            arms: tuple[IndexedArm, IndexedArm], policy: JudgePolicy, alpha_t: float,
            st: JudgeState) -> MetricEvidence:
    tau = policy.mixture_scale * spec.mde
    if spec.name == "error_rate":
        r_s, v_s = proportion_var(stable.error_count(), stable.request_count())
        r_c, v_c = proportion_var(canary.error_count(), canary.request_count())
        return compare(spec.name, (float(r_s), float(v_s), stable.request_count(), 0),
                       (float(r_c), float(v_c), canary.request_count(), 0),
                       direction=spec.direction, mde=spec.mde, tau=tau, alpha=alpha_t,
                       min_n=policy.min_users, state=st)
    s_sums, c_sums = _sums(spec.name, *arms)
    return compare(spec.name, arm_stats(s_sums), arm_stats(c_sums), direction=spec.direction,
                   mde=spec.mde, tau=tau, alpha=alpha_t, min_n=policy.min_users, state=st)


def _sums(name: str, stable: IndexedArm, canary: IndexedArm) -> tuple[Sums, Sums]:
    if name == "latency_tail":
        threshold = quantile((o.latency_ms for o in (*stable.outcomes, *canary.outcomes)), 0.95)
        fn = lambda o: float(o.latency_ms > threshold)  # noqa: E731
        return sums_for(stable, fn), sums_for(canary, fn)
    if name not in METRICS:
        known = sorted([*METRICS, "latency_tail", "error_rate"])
        raise ValueError(f"unknown metric {name!r}; known: {known}")
    return sums_for(stable, METRICS[name]), sums_for(canary, METRICS[name])


def _is_primary(e: MetricEvidence, specs: tuple[MetricSpec, ...]) -> bool:
    return any(s.name == e.metric and s.primary for s in specs)


def describe(e: MetricEvidence, level: float) -> str:
    """One plain-English clause with the numbers a reviewer needs."""
    label = LABELS.get(e.metric, e.metric)
    if e.status == "insufficient":
        return f"{label.capitalize()}: too few users yet ({e.n_canary} canary, {e.n_stable} stable)"
    unit = "requests" if e.metric == "error_rate" else "users"
    return (f"{label.capitalize()} {fmt_value(e.metric, e.canary_mean)} on the canary vs "
            f"{fmt_value(e.metric, e.stable_mean)} on stable (difference "
            f"{fmt_delta(e.metric, e.estimate)}, always-valid {level:.1%} interval "
            f"{fmt_delta(e.metric, e.ci_lower)} to {fmt_delta(e.metric, e.ci_upper)}, "
            f"p={e.p_value:.2g}; {e.n_canary:,} vs {e.n_stable:,} {unit})")


def _guard_reason(g: GuardrailResult) -> str:
    if g.name == "error_rate":
        return (f"Guardrail: canary error rate {g.canary_value:.2%} is over the {g.ceiling:.2%} "
                f"ceiling (stable {g.stable_value:.2%}).")
    return (f"Guardrail: canary p99 latency {g.canary_value:,.0f} ms is over the "
            f"{g.ceiling:,.0f} ms ceiling (stable {g.stable_value:,.0f} ms).")
