"""Cohorts for the judge (pure): which reward records belong to a canary, and their summary.

A record belongs to the canary's window when it was served at or after the canary started
and by the exact version of its arm: ``arm == "stable"`` and ``model.version`` = the stable
version, or ``arm == "canary"`` and the candidate version. Everything else (earlier canaries,
a different stable during a manual change, the long-term holdout's users) is left out, so both
arms cover the same window. :class:`HoldoutWindow` does the same for the champion against the
long-term holdout.

Every caller judges a window the same way, through :func:`judge_window` with a
:class:`JudgedOn`: the deployer at each tick, the holdout comparison, and ``rtrl replay``
re-judging a past canary from what its decision recorded (the boundaries, the gateway's
counts and how far the rewards topic had been read), so a replay reproduces the live verdict.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, NamedTuple

from deployer.status import Judgement
from ingest.contracts.metrics import PERSISTENCE_HORIZON_S, summarise
from ingest.events import RewardRecord
from rollback.columns import ColumnBuilder, outcome_from_reward
from rollback.judge import judge
from rollback.plan import CanaryPlan
from rollback.types import (
    CohortData,
    ErrorCount,
    JudgePolicy,
    JudgeState,
    RequestOutcome,
    Verdict,
)

ARMS = ("stable", "canary")

UserErrors = Mapping[str, Iterable[tuple[str, float, int]]]
"""arm -> (user, time bucket, errors) of the gateway's errors by user."""


@dataclass
class CohortWindow:
    """Request outcomes of one canary's window, per arm, collected record by record."""

    stable_version: str
    canary_version: str
    started_at: float
    outcomes: dict[str, list[RequestOutcome]] = field(default_factory=lambda: {a: [] for a in ARMS})
    seen: set[str] = field(default_factory=set)
    """request ids already counted (a record read twice after a rebalance counts once)."""
    horizon_s: int = PERSISTENCE_HORIZON_S
    """Edit persistence is judged at this horizon (the judge policy's)."""
    columns: dict[str, ColumnBuilder] = field(
        default_factory=lambda: {a: ColumnBuilder() for a in ARMS}, repr=False, compare=False)
    """The same outcomes as columns, kept as they arrive: the judge's tick then costs its new
    records plus vector passes, not a Python pass over the whole window (rollback/columns.py)."""
    read_to: dict[int, int] = field(default_factory=dict)
    """rewards partition -> the offset after the last record read into the window (whether
    or not it belonged): with the start time, exactly which records the window had seen."""

    SIDES: ClassVar[Mapping[str, str]] = {"stable": "stable", "canary": "canary"}
    """The served arm whose records each judged side holds (arm -> side)."""

    def side(self, record: RewardRecord) -> str | None:
        """The cohort ``record`` counts in (``stable`` or ``canary``), None when it is outside
        the window (another arm or version, or served before the window started)."""
        side = self.SIDES.get(record.arm)
        if side is None or record.served_ts.timestamp() < self.started_at:
            return None
        version = self.stable_version if side == "stable" else self.canary_version
        return side if record.model.version == version else None

    def belongs(self, record: RewardRecord) -> bool:
        return self.side(record) is not None

    def add(self, record: RewardRecord) -> bool:
        """Count ``record`` if it belongs to the window; True when it was counted."""
        side = self.side(record)
        if record.request_id in self.seen or side is None:
            return False
        self.seen.add(record.request_id)
        outcome = outcome_from_reward(record, self.horizon_s)
        self.outcomes[side].append(outcome)
        self.columns[side].add(outcome)
        return True

    def add_all(self, records: Iterable[RewardRecord]) -> int:
        return sum(self.add(r) for r in records)

    def read(self, partition: int, offset: int) -> None:
        """The record at ``offset`` of the rewards topic's ``partition`` has been read."""
        self.read_to[partition] = max(self.read_to.get(partition, 0), offset + 1)

    def cohorts(
        self, requests: Mapping[str, int] | None = None, errors: Mapping[str, int] | None = None,
        user_errors: UserErrors | None = None,
    ) -> tuple[CohortData, CohortData]:
        """(stable, canary) for ``rollback.judge.judge``; ``requests``/``errors`` are the
        gateway's per-arm counts when known (failed requests never make a reward record) and
        ``user_errors`` its errors by (user, time bucket)."""
        req, err, by_user = requests or {}, errors or {}, user_errors or {}
        stable, canary = (
            CohortData(arm=arm, outcomes=tuple(self.outcomes[arm]), requests=req.get(arm, 0),  # type: ignore[arg-type]
                       errors=err.get(arm, 0), columns=self.columns[arm].columns(),
                       user_errors=tuple(ErrorCount(u, ts, n) for u, ts, n in by_user.get(arm, ())))
            for arm in ARMS
        )
        return stable, canary


@dataclass(frozen=True)
class JudgedOn:
    """What a verdict is judged on besides the window's records: the time strata's boundaries,
    the time of the judgement, the gateway's counts (failed requests make no reward record)
    and how far the rewards topic had been read. The deployer records it with each decision
    (the ledger's ``decision.json``, key ``judged_on``) so ``rtrl replay`` can judge the same
    records the same way."""

    started_at: float
    at: float
    """When the judgement was made (the deployer's tick); ``elapsed_s`` counts from the start."""
    step_times: tuple[float, ...] = ()
    """When each weight step began: with the start, the boundaries of the time strata."""
    requests: Mapping[str, int] = field(default_factory=dict)
    errors: Mapping[str, int] = field(default_factory=dict)
    user_errors: UserErrors = field(default_factory=dict)
    read_to: Mapping[int, int] = field(default_factory=dict)
    """rewards partition -> offset after the last record read (:attr:`CohortWindow.read_to`)."""
    verdict: str | None = None
    """The decision the judge reached on these inputs (recorded, for a replay to compare)."""

    @property
    def boundaries(self) -> tuple[float, ...]:
        """The start, then each weight change: each begins a new time stratum."""
        return (self.started_at, *self.step_times)

    @property
    def elapsed_s(self) -> float:
        return self.at - self.started_at

    def to_doc(self) -> dict[str, Any]:
        """JSON-safe (partitions as strings, user errors as lists)."""
        return {
            "started_at": self.started_at, "at": self.at, "step_times": list(self.step_times),
            "requests": dict(self.requests), "errors": dict(self.errors),
            "user_errors": {arm: [list(e) for e in errs] for arm, errs in self.user_errors.items()},
            "read_to": {str(p): o for p, o in self.read_to.items()}, "verdict": self.verdict,
        }

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> JudgedOn:
        """The inverse of :meth:`to_doc`; raises ``KeyError``/``ValueError``/``TypeError`` on a
        document that is not one."""
        return cls(
            started_at=float(doc["started_at"]), at=float(doc["at"]),
            step_times=tuple(float(t) for t in doc.get("step_times") or ()),
            requests={str(k): int(v) for k, v in (doc.get("requests") or {}).items()},
            errors={str(k): int(v) for k, v in (doc.get("errors") or {}).items()},
            user_errors={str(arm): tuple((str(u), float(ts), int(n)) for u, ts, n in errs)
                         for arm, errs in (doc.get("user_errors") or {}).items()},
            read_to={int(p): int(o) for p, o in (doc.get("read_to") or {}).items()},
            verdict=None if doc.get("verdict") is None else str(doc["verdict"]),
        )

    def saw(self, partition: int, offset: int) -> bool:
        """Whether the judged window had read this record of the rewards topic."""
        return offset < self.read_to.get(partition, 0)


class Judged(NamedTuple):
    verdict: Verdict
    stable: CohortData
    canary: CohortData


def judge_window(window: CohortWindow, policy: JudgePolicy, on: JudgedOn,
                 state: JudgeState | None = None) -> Judged:
    """The judge on ``window`` as every caller runs it: the gateway's counts, the elapsed time
    and the time strata's boundaries from ``on``."""
    stable, canary = window.cohorts(on.requests, on.errors, on.user_errors)
    verdict = judge(stable, canary, policy, state, elapsed_s=on.elapsed_s, boundaries=on.boundaries)
    return Judged(verdict, stable, canary)


@dataclass
class HoldoutWindow(CohortWindow):
    """The champion against the long-term holdout (deployer/holdout.py) since ``started_at``:
    the holdout's records (arm ``holdout``, its pinned version) are the baseline, judged as
    ``stable``; the champion's (arm ``stable``, the champion's version) are judged as ``canary``.
    ``stable_version`` is the pinned version, ``canary_version`` the champion."""

    SIDES: ClassVar[Mapping[str, str]] = {"holdout": "stable", "stable": "canary"}


def summary(cohort: CohortData) -> dict[str, float]:
    """The cohort summary (``ingest.contracts.metrics.summarise``) with the arm's users and
    error rate, for the ledger and ``rtrl status`` (not the judge's tests). A figure without
    data is left out."""
    outs = cohort.outcomes
    if not outs:
        return {"n": 0.0, "users": 0.0}
    s = summarise(outs)
    out = {
        "n": float(s.n), "users": float(cohort.users()), "reward_mean": s.reward,
        "latency_mean_ms": s.latency_ms, "latency_p95_ms": s.latency_p95_ms,
        "dissatisfied_rate": s.dissatisfied_rate, "edit_rate": s.edit_rate,
        "error_rate": cohort.error_count() / max(1, cohort.request_count()),
        "acceptance": s.acceptance, "persistence": s.edit_persistence,
        "invalid_tool_rate": s.invalid_tool_rate,
    }
    return {k: v for k, v in out.items() if not math.isnan(v)}


def cohort_metrics(stable: CohortData, canary: CohortData) -> dict[str, float]:
    """``<arm>.<figure>`` for both arms, e.g. ``canary.reward_mean``."""
    return {f"{c.arm}.{k}": v for c in (stable, canary) for k, v in summary(c).items()}


def judgement(verdict: Verdict, on: JudgedOn | None = None, plan: CanaryPlan | None = None) -> Judgement:
    """The judge's verdict in the controller's terms, with flat statistics for the ledger
    (the plan's as ``plan.<metric>.needed`` / ``.eta_s`` and ``plan.eta_s``), what it was
    judged on (``on``, recorded with the verdict's decision) and the canary's plan."""
    stats = dict(verdict.stats()) | (plan_stats(plan) if plan is not None else {})
    stats["users.stable"], stats["users.canary"] = float(verdict.users_stable), float(verdict.users_canary)
    for g in verdict.guardrails:
        stats[f"guardrail.{g.name}.canary"] = float(g.canary_value)
        stats[f"guardrail.{g.name}.tripped"] = 1.0 if g.tripped else 0.0
    for d in verdict.detectors:
        stats[f"detector.{d.name}.fired"] = 1.0 if d.fired else 0.0
    return Judgement(
        decision=verdict.decision.value,
        reasons=tuple(verdict.reasons),
        stats=stats,
        state=dict(verdict.state),
        judged_on=replace(on, verdict=verdict.decision.value).to_doc() if on is not None else {},
        plan=plan.to_doc() if plan is not None else {},
    )


def plan_stats(plan: CanaryPlan) -> dict[str, float]:
    """The plan's figures that are known, flat, for the ledger's step metrics."""
    out = {"plan.users_per_min": plan.users_per_min}
    if plan.eta_s is not None:
        out["plan.eta_s"] = plan.eta_s
    for mp in plan.metrics:
        if mp.needed is not None:
            out[f"plan.{mp.metric}.needed"] = float(mp.needed)
        if mp.eta_s is not None:
            out[f"plan.{mp.metric}.eta_s"] = mp.eta_s
    return out
