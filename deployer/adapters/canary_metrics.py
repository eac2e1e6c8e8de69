"""The deployer's canary metrics: the gauges after each tick, the judge's statistics and
verdict, and the counters of a decision that ended a canary (services/wiring/deployer.py
calls :func:`export_metrics` once per tick)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ingest.contracts import prometheus as m

from deployer.ledger import CONTROLLER
from deployer.status import RESTING, CanaryStatus, Judgement, Observations, Phase


def reason_kind(status: CanaryStatus) -> str:
    """A low-cardinality label for why a canary ended."""
    if status.decided_by not in (None, CONTROLLER):
        return "operator"
    text = status.reason.lower()
    for kind in ("guardrail", "budget", "errors", "outside the controller", "inconclusive", "approval"):
        if kind in text:
            return kind.replace("outside the controller", "alias_moved")
    return "judge"


def export_metrics(before: CanaryStatus, after: CanaryStatus, obs: Observations) -> None:
    """The canary gauges after a tick, the judge's verdict, and the counters of a canary
    that this tick ended."""
    for phase in Phase:
        m.CANARY_PHASE.labels(phase.value).set(1.0 if phase == after.phase else 0.0)
    m.CANARY_WEIGHT.set(after.weight)
    m.CANARY_PHASE_AGE.set(max(0.0, obs.now - after.phase_since) if after.phase_since else 0.0)
    m.CANARY_BUDGET_USERS.set(float(after.budget_users) if after.phase not in RESTING else 0.0)
    j = obs.judgement
    if j is not None:
        export_judgement(j)
    ended = after.phase in RESTING and after.phase != Phase.IDLE
    if not ended or (after.phase, after.canary_id) == (before.phase, before.canary_id):
        return
    export_decision(after, j)


def export_judgement(j: Judgement) -> None:
    m.CANARY_VERDICTS.labels(j.decision).inc()
    for key, value in j.stats.items():
        if not key.startswith("plan."):
            metric, _, stat = key.rpartition(".")
            m.JUDGE_STAT.labels(metric, stat).set(value)
    export_plan(j.plan)


def export_plan(plan: Mapping[str, Any]) -> None:
    """The plan's gauges (-1 where a figure is unknown); nothing when the tick made no plan."""
    if not plan:
        return
    eta = plan.get("eta_s")
    m.CANARY_DECISION_ETA.set(-1.0 if eta is None else float(eta))
    for mp in plan.get("metrics", ()):
        for stat, key in (("users", "users"), ("needed", "needed"), ("eta_seconds", "eta_s")):
            value = mp.get(key)
            m.CANARY_PLAN.labels(mp["metric"], stat).set(-1.0 if value is None else float(value))


def export_decision(after: CanaryStatus, j: Judgement | None) -> None:
    """Count the decision that ended the canary: a promotion, a rollback (and the hacking
    detectors that fired for it) or an abort."""
    by = "controller" if after.decided_by in (None, CONTROLLER) else "operator"
    if after.phase == Phase.SUCCEEDED:
        m.CANARY_PROMOTIONS.labels(by).inc()
    elif after.phase == Phase.ROLLED_BACK:
        m.CANARY_ROLLBACKS.labels(reason_kind(after), by).inc()
    elif after.phase == Phase.ABORTED:
        m.CANARY_ABORTS.labels(reason_kind(after)).inc()
    if j is not None and after.outcome == "rolled_back":
        for key, value in j.stats.items():
            if key.startswith("detector.") and key.endswith(".fired") and value:
                m.HACKING_DETECTIONS.labels(key.split(".")[1]).inc()
