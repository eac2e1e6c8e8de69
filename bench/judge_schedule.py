"""``rtrl bench judge --schedule``: whole canaries run the way the deployer runs them, on
traffic from a generator that shares none of the judge's assumptions.

Each simulated canary is driven by the deployer's own state machine
(``deployer.canary.next_state``) under the deployer's default policy (steps 1 → 5 → 25 → 50 %,
``min_bake_s`` 120 s on a promote verdict, ``bake_s`` 600 s otherwise, the budget in users
from the plan, a 6-hour wall-clock cap), judged every ``--tick-s`` (the deployer's 30 s) by
``rollback.judge.judge`` under the default judge policy (``stratum_s`` 600 s), with the
plan of ``rollback.plan`` each tick, exactly as ``deployer.controller`` calls them.

Traffic, in continuous time (nothing aligned to ticks or strata):
- new users arrive as a Poisson process (``--users-per-min``, default 60: 300 per 5 minutes);
  each stays for an exponential session (mean 2 h) and requests as a Poisson process at a
  personal rate: the same for everyone, or Pareto-distributed (Zipf-like heavy users);
- a user is routed by a uniform hash against the weight at the moment of each request, so a
  user moves from stable to the canary as the weight grows, as the gateway's routing does;
- a reward record becomes visible to the judge 600-660 s after its request (the persistence
  horizon and the window's close);
- each user has their own acceptance, persistence, dissatisfaction and latency levels;
  shared drifts move with wall-clock time: latency rising 30 % over 6 hours, persistence on a
  24-hour cycle whose phase is random per canary.

Shapes: A/A under drift; A/A with Zipf users; A/A with Pareto latency; a persistence
regression of one and of two MDEs (Zipf users); a latency regression of one and of two MDEs.
Agent shapes (judged with the per-session metrics too, as a session reward spec makes the
deployer do): each request is an agent session's lead turn, with the user's own completion
propensity (a 24-hour cycle shared by both arms), turns (more when abandoned) and broken tool
calls; the record is visible once the session has closed and its window with it. A/A with Zipf
users; completion down one and two MDEs; turns per completed session and sessions with an
invalid tool call up one MDE.
Per shape: how canaries ended (false rollbacks with a 95 % upper bound for A/A shapes;
promotions within the budget; detections before any promotion for regressions), the canary
users and hours at decision. ``--baselines`` adds Kayenta- and Flagger-style judges on the
same traffic (bench/judge_schedule_baselines.py); the command is bench/judge_schedule_run.py.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np
from numpy.typing import NDArray
from scipy import stats as sps

from deployer.canary import next_state
from deployer.status import CanaryPolicy, CanaryStatus, Judgement, Observations
from rollback.columns import ColumnBuilder
from rollback.judge import judge
from rollback.metrics import session_metrics
from rollback.plan import plan_canary
from rollback.types import CohortData, JudgePolicy, RequestOutcome, Verdict, default_metrics

HOURS = 6.0
SESSION_MEAN_S = 2 * 3600.0
REQUESTS_PER_HOUR = 3.0
VISIBLE_AFTER_S = (600.0, 660.0)
KINDS = np.array(["edit", "question", "empty"])
Flags = NDArray[np.bool_]


@dataclass(frozen=True)
class Shape:
    name: str
    aa: bool = True
    zipf: bool = False
    pareto: bool = False
    persistence_effect: float = 0.0
    latency_effect_ms: float = 0.0
    agent: bool = False
    completion_effect: float = 0.0
    turns_effect: float = 0.0
    invalid_effect: float = 0.0

    @property
    def metric(self) -> str:
        """The metric the shape regresses (persistence, or session completion, for A/A shapes)."""
        effects = {"latency_ms": self.latency_effect_ms, "turns_per_completed": self.turns_effect,
                   "session_invalid_tool_rate": self.invalid_effect}
        return next((m for m, e in effects.items() if e),
                    "session_completion" if self.agent else "persistence")


SHAPES = {s.name: s for s in (
    Shape("A/A, drift"),
    Shape("A/A, Zipf users", zipf=True),
    Shape("A/A, Pareto latency", pareto=True),
    Shape("persistence -1 MDE, Zipf", aa=False, zipf=True, persistence_effect=-0.03),
    Shape("latency +1 MDE", aa=False, latency_effect_ms=100.0),
    Shape("persistence -2 MDE, Zipf", aa=False, zipf=True, persistence_effect=-0.06),
    Shape("latency +2 MDE", aa=False, latency_effect_ms=200.0),
    Shape("A/A, agent sessions, Zipf", zipf=True, agent=True),
    Shape("completion -1 MDE, agent, Zipf", aa=False, zipf=True, agent=True, completion_effect=-0.05),
    Shape("completion -2 MDE, agent, Zipf", aa=False, zipf=True, agent=True, completion_effect=-0.10),
    Shape("turns +1 MDE, agent", aa=False, agent=True, turns_effect=0.5),
    Shape("invalid calls +1 MDE, agent", aa=False, agent=True, invalid_effect=0.05),
)}


@dataclass(frozen=True)
class Result:
    shape: str
    outcome: str
    """promoted | rolled_back | aborted | undecided"""
    hours: float
    canary_users: int
    reason: str
    var_per_user: float = math.nan
    """Canary users × the variance of the shape's metric's difference at the end (the plan's
    per-user variance): what sizes a fixed-horizon test."""


class Traffic:
    """One canary's users and requests (served times, user, hash), drawn up front; outcomes
    are drawn when a request is served, knowing its arm."""

    def __init__(self, shape: Shape, rng: np.random.Generator, users_per_min: float,
                 hours: float = HOURS) -> None:
        span = hours * 3600.0
        n = int(rng.poisson(users_per_min / 60.0 * span))
        arrive = rng.uniform(0.0, span, n)
        stay = rng.exponential(SESSION_MEAN_S, n)
        rate = np.full(n, REQUESTS_PER_HOUR / 3600.0)
        if shape.zipf:  # Pareto activity with the same mean, capped at 200x the median
            raw = sps.pareto.rvs(1.2, size=n, random_state=rng)
            rate = rate * np.minimum(raw / np.mean(np.minimum(raw, 200.0)), 200.0)
        counts = 1 + rng.poisson(rate * np.minimum(stay, span - arrive))
        user = np.repeat(np.arange(n), counts)
        first = np.zeros(len(user), dtype=bool)
        first[np.cumsum(counts) - counts] = True
        t = np.where(first, arrive[user], arrive[user] + rng.uniform(0, 1, len(user))
                     * np.minimum(stay, span - arrive)[user])
        order = np.argsort(t, kind="stable")
        self.t, self.user = t[order], user[order]
        self.hash = rng.uniform(0, 1, n)
        self.accept = rng.beta(4, 4, n)
        self.persist = rng.beta(0.6 * 8, 0.4 * 8, n)
        self.dissatisfied = rng.beta(1, 19, n)
        self.latency = np.exp(rng.normal(0.0, 0.3, n))
        self.phase = rng.uniform(0, 2 * math.pi)
        self.complete = rng.beta(0.45 * 6, 0.55 * 6, n)  # agent sessions: the user's propensities
        self.turns = rng.gamma(4.0, 1.25, n)
        self.broken = rng.beta(1, 7, n)
        self.shape, self.rng, self.next = shape, rng, 0

    def served(self, until: float, weight: float) -> Iterator[tuple[str, RequestOutcome, float]]:
        """Requests served up to ``until`` at the canary ``weight``: (arm, outcome, visible at)."""
        lo, hi = self.next, int(np.searchsorted(self.t, until, side="right"))
        self.next = hi
        if hi <= lo:
            return
        rng, shape, t, u = self.rng, self.shape, self.t[lo:hi], self.user[lo:hi]
        canary = self.hash[u] < weight
        k = hi - lo
        drift = 1.0 + 0.3 * t / (HOURS * 3600.0)
        if shape.pareto:
            lat = 150.0 * sps.pareto.rvs(1.5, size=k, random_state=rng) * drift
        else:
            lat = 400.0 * self.latency[u] * np.exp(rng.normal(0.0, 0.6, k)) * drift
        lat = lat + np.where(canary, shape.latency_effect_ms, 0.0)
        kind = KINDS[rng.choice(3, size=k, p=(0.8, 0.15, 0.05))]
        accepted = (kind == "edit") & (rng.uniform(0, 1, k) < self.accept[u])
        cycle = 0.05 * np.sin(2 * math.pi * t / 86_400.0 + self.phase)
        level = np.clip(self.persist[u] + cycle + np.where(canary, shape.persistence_effect, 0.0), 0.01, 0.99)
        ratio = rng.beta(level * 6, (1 - level) * 6)
        unhappy = rng.binomial(1, self.dissatisfied[u])
        reward = np.where(accepted, ratio, 0.0) - 0.0005 * lat + rng.normal(0, 0.1, k)
        tokens = rng.poisson(40, k)
        visible = t + rng.uniform(*VISIBLE_AFTER_S, k)
        turns, done, broken = self._sessions(t, u, canary)
        if shape.agent:  # the record waits for the session to close (a turn every ~40 s)
            visible = visible + turns * rng.uniform(20.0, 60.0, k)
        for i in range(k):
            arm = "canary" if canary[i] else "stable"
            yield arm, RequestOutcome(
                user_key=f"u{u[i]}", reward=float(reward[i]), latency_ms=float(lat[i]),
                persistence=float(ratio[i]) if accepted[i] else None,
                accepted=bool(accepted[i]) if kind[i] == "edit" else None, dissatisfied=int(unhappy[i]),
                completion_kind=str(kind[i]),  # type: ignore[arg-type]
                completion_tokens=int(tokens[i]), ts=float(t[i]),
                session_turns=int(turns[i]), session_completed=bool(done[i]), session_invalid=bool(broken[i]),
            ), float(visible[i])

    def _sessions(self, t: NDArray[np.float64], u: NDArray[np.int64],
                  canary: NDArray[np.bool_]) -> tuple[NDArray[np.int64], Flags, Flags]:
        """Each request's agent session (zeros for a shape without sessions): turns, completed,
        made an invalid tool call. Completion follows the user's propensity on a shared 24-hour
        cycle; an abandoned session runs longer before the user gives up."""
        k, shape, rng = len(t), self.shape, self.rng
        if not shape.agent:
            return np.zeros(k, np.int64), np.zeros(k, bool), np.zeros(k, bool)
        cycle = 0.05 * np.sin(2 * math.pi * t / 86_400.0 + self.phase + 1.0)
        p = np.clip(self.complete[u] + cycle + np.where(canary, shape.completion_effect, 0.0), 0.01, 0.99)
        done = rng.uniform(0, 1, k) < p
        mean = self.turns[u] + np.where(done, 0.0, 2.0) + np.where(canary & done, shape.turns_effect, 0.0)
        turns = 1 + rng.poisson(np.maximum(mean, 0.0))
        broken = rng.uniform(0, 1, k) < self.broken[u] + np.where(canary, shape.invalid_effect, 0.0)
        return turns.astype(np.int64), done, broken


def policy_for(shape: Shape) -> JudgePolicy:
    """The deployer's default judge; with agent sessions, the per-session metrics too."""
    return JudgePolicy(metrics=default_metrics() + session_metrics()) if shape.agent else JudgePolicy()


def run_canary(shape_name: str, seed: int, tick_s: float, users_per_min: float,
               hours: float = HOURS) -> Result:
    """One canary from its start to its decision, or ``hours`` (the deployer's 6-hour cap;
    shorter: only the canary's first hours, e.g. to count early rollbacks at a fine tick)."""
    shape = SHAPES[shape_name]
    rng = np.random.default_rng(seed)
    traffic = Traffic(shape, rng, users_per_min, hours)
    cpol, jpol = CanaryPolicy(), policy_for(shape)
    status = CanaryStatus()
    cols = {"stable": ColumnBuilder(), "canary": ColumnBuilder()}
    outs: dict[str, list[RequestOutcome]] = {"stable": [], "canary": []}
    waiting: list[tuple[float, str, RequestOutcome]] = []
    state: dict[str, float] | None = None
    verdict = None
    now = 0.0
    while now <= hours * 3600.0 + tick_s:
        judgement = None
        waiting += [(vis, arm, o) for arm, o, vis in traffic.served(now, status.weight)]
        ready = [w for w in waiting if w[0] <= now]
        waiting = [w for w in waiting if w[0] > now]
        for _, arm, o in ready:
            cols[arm].add(o)
            outs[arm].append(o)
        if status.phase.value in ("progressing", "awaiting_approval"):
            stable, canary = (CohortData(arm=a, outcomes=tuple(outs[a]), columns=cols[a].columns())
                              for a in ("stable", "canary"))
            verdict = judge(stable, canary, jpol, state, elapsed_s=now - status.started_at,
                            boundaries=(status.started_at, *status.step_times))
            state = dict(verdict.state)
            plan = plan_canary(verdict, jpol, cpol.steps, status.step, now - status.step_since,
                               now - status.started_at, cpol.bake_s)
            judgement = Judgement(verdict.decision.value, tuple(verdict.reasons), plan=plan.to_doc())
        obs = Observations(now=now, champion="1", candidate="2", gate={"2": "pass"}, judgement=judgement)
        status, _ = next_state(status, obs, cpol)
        if status.outcome:
            users = len({o.user_key for o in outs["canary"]})
            hours = (now - status.started_at) / 3600.0
            return Result(shape.name, status.outcome, hours, users, status.reason[:160],
                          _var_per_user(verdict, shape.metric))
        now += tick_s if status.phase.value != "pending" else 1.0
    return Result(shape.name, "undecided", hours, len({o.user_key for o in outs["canary"]}), "")


def _var_per_user(verdict: Verdict | None, metric: str) -> float:
    ev = {e.metric: e for e in verdict.metrics}.get(metric) if verdict else None
    if ev is None or not ev.n_canary or not math.isfinite(ev.var_canary + ev.var_stable):
        return math.nan
    return (ev.var_canary + ev.var_stable) * ev.n_canary


def fixed_horizon_users(var_per_user: float, metric: str, policy: JudgePolicy, power: float = 0.95) -> float:
    """Canary users a fixed-horizon test needs to catch a regression of one MDE of ``metric``
    with ``power``, one-sided at the judge's per-test α, for this per-user variance."""
    mde = {s.name: s.mde for s in policy.metrics}[metric]
    z = NormalDist().inv_cdf(1.0 - policy.alpha_per_test()) + NormalDist().inv_cdf(power)
    return math.ceil(z * z * var_per_user / (mde * mde)) if math.isfinite(var_per_user) else math.nan


def upper95(k: int, n: int) -> float:
    """Clopper-Pearson upper bound of a rate seen k times in n."""
    return 1.0 if k >= n else float(sps.beta.ppf(0.975, k + 1, n - k))


def _median(xs: list[float] | list[int]) -> float | None:
    return float(np.median(xs)) if xs else None


def summarise(results: list[Result]) -> dict[str, object]:
    n = len(results)
    by = {o: [r for r in results if r.outcome == o]
          for o in ("promoted", "rolled_back", "aborted", "undecided")}
    promoted = by["promoted"]
    rolled = by["rolled_back"]
    return {
        "canaries": n, **{o: len(v) for o, v in by.items()},
        "rollback_rate": len(rolled) / n, "rollback_upper95": upper95(len(rolled), n),
        "promotion_rate": len(promoted) / n,
        "median_users_to_promotion": _median([r.canary_users for r in promoted]),
        "median_hours_to_promotion": _median([r.hours for r in promoted]),
        "median_users_to_rollback": _median([r.canary_users for r in rolled]),
        "median_hours_to_rollback": _median([r.hours for r in rolled]),
        "median_var_per_user": _median([r.var_per_user for r in results if math.isfinite(r.var_per_user)]),
        "abort_reasons": sorted({r.reason.split(" (")[0][:80] for r in by["aborted"]})[:3],
    }
