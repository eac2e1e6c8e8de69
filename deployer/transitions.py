"""Transitions shared by the phase rules (deployer/canary.py) and operator commands
(deployer/commands.py): enter a phase, start a canary, decide its outcome. Pure."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from deployer import ledger, records
from deployer.actions import Action, EngineLoad, LedgerOpen, SetRouting, SetWeight, WriteTags
from deployer.status import CanaryPolicy, CanaryStatus, Observations, Phase, Result
from ingest.contracts.registry import FATE, OUTCOME_RUNNING, TAG_CANARY_ID


def enter(status: CanaryStatus, phase: Phase, now: float, **changes: Any) -> CanaryStatus:
    if phase == status.phase:
        return replace(status, **changes)
    return replace(status, phase=phase, phase_since=now, **changes)


def start(
    status: CanaryStatus, obs: Observations, policy: CanaryPolicy, cand: str, kind: str
) -> Result:
    now, stable = obs.now, obs.champion
    prefix = {"canary": "canary", "manual_promote": "promote", "manual_rollback": "restore"}[kind]
    cid = ledger.canary_id(prefix, cand, now)
    fresh = CanaryStatus(
        phase=Phase.PENDING if kind == "canary" else Phase.PROMOTING,
        paused=status.paused, kind=kind, canary_id=cid, candidate=cand, stable=stable,
        started_at=now, phase_since=now, step_since=now, handled=status.handled,
    )
    params = ledger.open_params(cand, stable, policy.steps, policy.bake_s, policy.max_duration_s,
                                policy.min_bake_s, policy.budget_factor)
    tags = ledger.open_tags(cid, kind, cand, stable, obs.lineage.get(cand, {}))
    actions: list[Action] = [LedgerOpen(cid, params, tags, now)]
    if kind == "canary":
        actions += [
            WriteTags(cand, {ledger.TAG_OUTCOME: OUTCOME_RUNNING, TAG_CANARY_ID: cid,
                             FATE: records.CANARY}),
            SetRouting(stable=stable, canary=cand, weight=0.0, salt=cid),
        ]
        if obs.engine is not None:  # loaded and checked before the first step (deployer/engine.py)
            actions.append(EngineLoad(cand))
    return fresh, actions


def decide(
    status: CanaryStatus, now: float, outcome: str, reason: str, by: str, actions: list[Action] | None = None
) -> Result:
    """Enter promoting or rolling_back. A losing canary gets weight 0 in this very tick."""
    actions = list(actions or [])
    if outcome == "promoted":
        return enter(status, Phase.PROMOTING, now, outcome=outcome, reason=reason, decided_by=by), actions
    actions.append(SetWeight(0.0))
    return enter(status, Phase.ROLLING_BACK, now, outcome=outcome, reason=reason, decided_by=by,
                  weight=0.0), actions
