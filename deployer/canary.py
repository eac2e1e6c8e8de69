"""The canary state machine: one pure transition over an explicit phase enum.

``next_state(status, observations, policy) -> (status, actions)`` is all the controller
decides; deployer/controller.py reads the observations, applies the actions through
adapters and persists the status after every tick, so a restarted controller resumes in
the phase it left. Each phase has its own small function below.

Lifecycle::

    idle ─candidate passed the gate─▶ pending ─routing set─▶ progressing (step weights, judge)
    progressing ─promote at last step─▶ promoting ─aliases moved─▶ succeeded
    progressing ─promote, approval required─▶ awaiting_approval ─rtrl approve─▶ promoting
    awaiting_approval ─rtrl rollback / judge turns / approval timed out─▶ rolling_back
    progressing ─rollback / guardrail─▶ rolling_back ─────────────▶ rolled_back
    progressing ─inconclusive / budget / errors─▶ rolling_back ───▶ aborted

``paused`` is a flag, not a phase: it holds the weight and blocks promotion, never a rollback.
Operator commands reach ``next_state`` verified (deployer/operators.py); refused ones are
only recorded: a line in ``handled`` for the CLI and a ledger record of their own.
The phases, the status and the policy are deployer/status.py; the transitions that phase
rules and operator commands (deployer/commands.py) share are deployer/transitions.py.
"""

from __future__ import annotations

import math
from dataclasses import replace

from deployer import holdout, ledger, records
from deployer.actions import (
    Action,
    DeleteAlias,
    EngineLoad,
    EngineUnload,
    LedgerClose,
    LedgerNote,
    LedgerRefusal,
    LedgerStep,
    MoveAlias,
    SetRouting,
    SetWeight,
    WriteTags,
)
from deployer.commands import handle
from deployer.engine import FAILED, READY
from deployer.status import (
    RESTING,
    RESULT_PHASE,
    CanaryPolicy,
    CanaryStatus,
    Command,
    Observations,
    Phase,
    Refusal,
    Result,
)
from deployer.transitions import decide, enter, start
from ingest.contracts.registry import (
    CANDIDATE,
    CHAMPION,
    CHAMPION_SINCE,
    CHAMPION_SUCCESSOR,
    CHAMPION_UNTIL,
    FATE,
    PREVIOUS,
)

BUDGET_TAG = "rtrl.canary.budget_users"
"""Ledger tag: the canary's budget in canary users when its plan first set it."""
HANDLED_KEPT = 20
"""Operator commands remembered as handled (a restarted controller skips them)."""


# ============================================================================ transition
def next_state(status: CanaryStatus, obs: Observations, policy: CanaryPolicy) -> Result:
    """The one transition: operator commands first, then the current phase's rule."""
    actions: list[Action] = []
    for refusal in obs.refused:
        if not _handled(status, refusal.command.id):
            status, more = _refuse(status, obs.now, refusal)
            actions += more
    for cmd in obs.commands:
        if _handled(status, cmd.id):
            continue  # handled before a crash; the queue was not trimmed yet
        status, more, result = _command(status, obs, policy, cmd)
        status = _note_handled(status, cmd.id, result)
        actions += more
    status, more = PHASE_RULES[status.phase](status, obs, policy)
    actions += more
    return status, actions + holdout.upkeep(obs, actions) + engine_upkeep(status, obs)


def engine_upkeep(status: CanaryStatus, obs: Observations) -> list[Action]:
    """With an engine: keep the champion loaded (an engine restart loses adapters) and unload
    every version that no longer serves (rolled back, aborted, superseded, failed)."""
    if obs.engine is None:
        return []
    keep = {obs.champion}
    if status.phase not in RESTING or status.phase == Phase.SUCCEEDED:
        keep.add(status.candidate)  # in flight, or the champion promoted this very tick
    if status.phase not in RESTING:
        keep.add(status.stable)
    served = [obs.champion]
    if obs.holdout is not None and obs.holdout.active(obs.now):
        served.append(obs.holdout.version)  # the holdout's users are served it until it ends
        keep.add(obs.holdout.version)
    actions: list[Action] = []
    for version in dict.fromkeys(v for v in served if v is not None):
        state = obs.engine.get(version)
        if state is None or state.state != FAILED:
            actions.append(EngineLoad(version))  # a no-op while the engine still lists it
    actions += [EngineUnload(v) for v in sorted(obs.engine) if v not in keep]
    return actions


# ---------------------------------------------------------------------------- resting
def _resting(status: CanaryStatus, obs: Observations, policy: CanaryPolicy) -> Result:
    """idle / succeeded / rolled_back / aborted: start a canary for a new, gated candidate."""
    cand = obs.candidate
    if cand is None or cand == status.candidate or cand == obs.champion:
        return replace(status, note=""), []
    if status.paused:
        return replace(status, note=f"paused: candidate v{cand} waits"), []
    if obs.champion is None:
        return replace(status, note=f"no champion to compare v{cand} against: promote one by hand"), []
    gate = obs.gate.get(cand)
    if gate != "pass":
        return replace(status, note=f"candidate v{cand} not deployed: gate result {gate or 'missing'}"), []
    return start(status, obs, policy, cand, kind="canary")


# ---------------------------------------------------------------------------- pending
def _pending(status: CanaryStatus, obs: Observations, policy: CanaryPolicy) -> Result:
    """Routing is in place at weight 0: send the first step's share of users."""
    if obs.candidate != status.candidate:
        return decide(status, obs.now, "aborted", _alias_moved(status, obs), ledger.CONTROLLER)
    if obs.engine is not None:
        engine = obs.engine.get(status.candidate or "")
        if engine is not None and engine.state == FAILED:
            return decide(status, obs.now, "rolled_back", f"engine: {engine.reason}", ledger.CONTROLLER)
        if engine is None or engine.state != READY:  # no traffic before it is loaded and checked
            return replace(status, note=f"loading v{status.candidate} into the engine"), \
                [EngineLoad(str(status.candidate))]
    if status.paused:
        return status, []
    w = policy.steps[0]
    return enter(status, Phase.PROGRESSING, obs.now, step=0, weight=w, step_since=obs.now,
                 step_times=(obs.now,)), [SetWeight(w)]


# ---------------------------------------------------------------------------- progressing
def _progressing(status: CanaryStatus, obs: Observations, policy: CanaryPolicy) -> Result:
    """Judge every tick; roll back at once on a losing verdict; abort once the budget (users
    or wall clock) is spent; step up on a promote verdict after ``min_bake_s`` or on any
    other after ``bake_s``; promote only from the last step, on a promote verdict."""
    now = obs.now
    if obs.candidate != status.candidate:
        return decide(status, now, "aborted", _alias_moved(status, obs), ledger.CONTROLLER)
    if obs.error is not None:
        return _on_error(status, obs, policy)
    status, actions = _record(replace(status, errors=0, note=""), obs)
    verdict = obs.judgement.decision if obs.judgement else "continue"
    if verdict == "rollback":
        return decide(status, now, "rolled_back", _why(status, "judge: canary worse"), ledger.CONTROLLER,
                       actions)
    if verdict == "inconclusive":
        return decide(status, now, "aborted", _why(status, "judge: inconclusive"), ledger.CONTROLLER,
                       actions)
    if now - status.started_at > policy.max_duration_s:
        reason = f"inconclusive: no decision within the {policy.max_duration_s:g}s budget"
        return decide(status, now, "aborted", reason, ledger.CONTROLLER, actions)
    status, spent, more = _budget(status, obs, policy)
    actions += more
    if spent:
        return decide(status, now, "aborted", spent, ledger.CONTROLLER, actions)
    return _advance(status, now, policy, verdict, actions)


def _advance(status: CanaryStatus, now: float, policy: CanaryPolicy, verdict: str,
             actions: list[Action]) -> Result:
    """Step up, or promote from the last step. A promote verdict is the evidence that moves
    a step after ``min_bake_s``; without it a step moves after ``bake_s``."""
    baked = now - status.step_since
    least = min(policy.min_bake_s, policy.bake_s)
    if status.paused or baked < least or (verdict != "promote" and baked < policy.bake_s):
        return status, actions
    if status.step + 1 < len(policy.steps):
        w = policy.steps[status.step + 1]
        return replace(status, step=status.step + 1, weight=w, step_since=now,
                       step_times=(*status.step_times, now)), [*actions, SetWeight(w)]
    if verdict == "promote":
        reason = _why(status, "judge: canary at least as good on every metric")
        if policy.approval_required:
            return _await_approval(status, now, policy, reason, actions)
        return decide(status, now, "promoted", reason, ledger.CONTROLLER, actions)
    return status, actions


def _budget(status: CanaryStatus, obs: Observations,
            policy: CanaryPolicy) -> tuple[CanaryStatus, str, list[Action]]:
    """The canary's budget in users, from this tick's plan (rollback/plan.py): the budget is
    ``budget_factor`` × the largest need of an undecided primary metric seen so far. Spent
    (a reason) once every undecided metric has ``budget_factor`` × its need and no verdict."""
    plans = obs.judgement.plan.get("metrics", ()) if obs.judgement is not None else ()
    open_ = [p for p in plans if not p.get("decided")]
    if policy.budget_factor is None or not open_ or any(p.get("needed") is None for p in open_):
        return status, "", []
    factor = policy.budget_factor
    budget = max(status.budget_users, math.ceil(factor * max(int(p["needed"]) for p in open_)))
    actions: list[Action] = []
    if status.budget_users == 0 and status.canary_id is not None:
        actions.append(LedgerNote(status.canary_id, BUDGET_TAG, str(budget)))
    status = replace(status, budget_users=budget)
    if all(int(p.get("users", 0)) >= factor * int(p["needed"]) for p in open_):
        names = ", ".join(f"{p.get('metric')} {int(p['users']):,} of {int(p['needed']):,}" for p in open_)
        return status, (f"inconclusive: the budget of {budget:,} canary users ({factor:g}x the plan) is "
                        f"spent without a decision (canary users of planned: {names})"), actions
    return status, "", actions


# ---------------------------------------------------------------------------- approval
def _await_approval(status: CanaryStatus, now: float, policy: CanaryPolicy, reason: str,
                    actions: list[Action]) -> Result:
    """The judge would promote; an operator decides. The canary keeps its weight meanwhile."""
    cid = status.canary_id
    assert cid is not None
    status = enter(status, Phase.AWAITING_APPROVAL, now, reason=reason)
    note = LedgerNote(cid, "rtrl.approval.requested", f"{ledger.iso(now)}: {reason}")
    return replace(status, note=_approval_note(status, policy)), [*actions, note]


def _approval_note(status: CanaryStatus, policy: CanaryPolicy) -> str:
    deadline = ledger.iso(status.phase_since + policy.approval_timeout_s) if status.phase_since else "?"
    return (f"v{status.candidate} passed the judge: rtrl approve {status.candidate} promotes it, "
            f"rtrl rollback rejects it; rolled back at {deadline} without a decision")


def _awaiting_approval(status: CanaryStatus, obs: Observations, policy: CanaryPolicy) -> Result:
    """Hold the weight and keep judging: a losing verdict still rolls back at once; no
    operator decision within ``approval_timeout_s`` rolls back too."""
    now = obs.now
    if obs.candidate != status.candidate:
        return decide(status, now, "aborted", _alias_moved(status, obs), ledger.CONTROLLER)
    if obs.error is not None:
        return _on_error(status, obs, policy)
    status, actions = _record(replace(status, errors=0, note=_approval_note(status, policy)), obs)
    if obs.judgement is not None and obs.judgement.decision == "rollback":
        return decide(status, now, "rolled_back", _why(status, "judge: canary worse"), ledger.CONTROLLER,
                      actions)
    if now - status.phase_since > policy.approval_timeout_s:
        reason = f"approval timed out after {policy.approval_timeout_s:g}s"
        return decide(status, now, "rolled_back", reason, ledger.CONTROLLER, actions)
    return status, actions


def _record(status: CanaryStatus, obs: Observations) -> Result:
    """Keep the verdict in the status and write one ledger step for it."""
    j = obs.judgement
    if j is None:
        return replace(status, cohorts=dict(obs.cohorts) or status.cohorts), []
    step = status.ticks + 1
    status = replace(
        status, ticks=step, verdict=j.decision, reasons=tuple(j.reasons), judge_state=dict(j.state),
        cohorts=dict(obs.cohorts), judged_on=dict(j.judged_on), plan=dict(j.plan),
    )
    metrics = ledger.step_metrics(status.weight, j.decision, obs.cohorts, j.stats, status.paused)
    assert status.canary_id is not None
    return status, [LedgerStep(status.canary_id, step, obs.now, metrics)]


def _on_error(status: CanaryStatus, obs: Observations, policy: CanaryPolicy) -> Result:
    errors = status.errors + 1
    status = replace(status, errors=errors, note=f"observation error: {obs.error}")
    if errors < policy.max_errors:
        return status, []
    reason = f"{errors} consecutive observation errors, last: {obs.error}"
    return decide(status, obs.now, "aborted", reason, ledger.CONTROLLER)


def _why(status: CanaryStatus, head: str) -> str:
    return head + (": " + _listed(status.reasons) if status.reasons else "")


def _listed(reasons: tuple[str, ...]) -> str:
    """The judge's reasons in a decision's one-line reason (which then ends with them)."""
    return "; ".join(reasons)


def _alias_moved(status: CanaryStatus, obs: Observations) -> str:
    return f"candidate alias changed outside the controller (v{status.candidate} -> {obs.candidate})"


# ---------------------------------------------------------------------------- finishing
def _promoting(status: CanaryStatus, obs: Observations, policy: CanaryPolicy) -> Result:
    """champion -> candidate, previous -> old champion, candidate alias removed, routing
    to the new champion at weight 0. Derived from the status only, so re-running is safe."""
    cand, old = status.candidate, status.stable
    assert cand is not None and status.canary_id is not None
    actions: list[Action] = [EngineLoad(cand, required=True)] if obs.engine is not None else []
    actions.append(SetRouting(stable=cand, canary=None, weight=0.0, salt=status.canary_id))
    if old is not None and old != cand:
        actions.append(MoveAlias(PREVIOUS, old))
    actions += [MoveAlias(CHAMPION, cand), DeleteAlias(CANDIDATE, cand)]
    return _close(status, obs.now, actions)


def _rolling_back(status: CanaryStatus, obs: Observations, policy: CanaryPolicy) -> Result:
    """Stable keeps serving (weight is 0 already); the candidate alias goes away."""
    cand = status.candidate
    assert cand is not None and status.canary_id is not None
    actions: list[Action] = [
        SetRouting(stable=status.stable, canary=None, weight=0.0, salt=status.canary_id),
        DeleteAlias(CANDIDATE, cand),
    ]
    return _close(status, obs.now, actions)


def _close(status: CanaryStatus, now: float, actions: list[Action]) -> Result:
    """Tag the version, close the ledger run and rest in the outcome's phase. An operator's
    restore of an older champion tags the champion it replaced as rolled back."""
    cand, cid, outcome = status.candidate, status.canary_id, status.outcome
    assert cand is not None and cid is not None and outcome in RESULT_PHASE
    by = status.decided_by or ledger.CONTROLLER
    tagged = status.stable if status.kind == "manual_rollback" else cand
    summary = ledger.summary(cid, cand, status.stable, outcome, status.reason, by, status.started_at, now,
                             status.reasons, status.cohorts, status.judged_on)
    reasons = status.reasons if status.reason.endswith(_listed(status.reasons)) else ()
    if tagged is not None:
        actions.append(WriteTags(tagged, ledger.version_tags(cid, outcome, status.reason, by, now, reasons)))
    actions += fate_tags(status, now)
    actions += [
        LedgerClose(cid, now, ledger.decision_tags(outcome, status.reason, by, now, reasons), summary),
    ]
    return enter(status, RESULT_PHASE[outcome], now, weight=0.0, step=-1), actions


def fate_tags(status: CanaryStatus, now: float) -> list[Action]:
    """``rtrl.fate`` of the versions a decision touched (deployer/records.py): a promoted
    candidate becomes the champion and the one it replaced is superseded; a restore by hand
    makes the older version the champion again and the replaced champion rolled back; a
    canary rolled back or aborted leaves its candidate rolled back."""
    cand, stable, outcome = status.candidate, status.stable, status.outcome
    assert cand is not None and outcome is not None
    at = ledger.iso(now)
    champion = {FATE: records.PROMOTED, CHAMPION_SINCE: at, CHAMPION_UNTIL: "", CHAMPION_SUCCESSOR: ""}
    replaced = {CHAMPION_UNTIL: at, CHAMPION_SUCCESSOR: cand}
    if status.kind == "manual_rollback":
        out: list[Action] = [WriteTags(cand, champion)]
        if stable is not None:
            out.append(WriteTags(stable, {FATE: records.ROLLED_BACK, **replaced}))
        return out
    if outcome != "promoted":
        return [WriteTags(cand, {FATE: records.fate_of_outcome(outcome)})]
    out = [WriteTags(cand, champion)]
    if stable is not None and stable != cand:
        out.append(WriteTags(stable, {FATE: records.SUPERSEDED, **replaced}))
    return out


PHASE_RULES = {
    Phase.IDLE: _resting,
    Phase.SUCCEEDED: _resting,
    Phase.ROLLED_BACK: _resting,
    Phase.ABORTED: _resting,
    Phase.PENDING: _pending,
    Phase.PROGRESSING: _progressing,
    Phase.AWAITING_APPROVAL: _awaiting_approval,
    Phase.PROMOTING: _promoting,
    Phase.ROLLING_BACK: _rolling_back,
}


# ---------------------------------------------------------------------------- operators
def _command(
    status: CanaryStatus, obs: Observations, policy: CanaryPolicy, cmd: Command
) -> tuple[CanaryStatus, list[Action], str]:
    """Handle one operator command; returns the new status, actions and a result line."""
    return handle(status, obs, policy, cmd)


def _handled(status: CanaryStatus, command_id: str) -> bool:
    return any(command_id == done for done, _ in status.handled)


def _note_handled(status: CanaryStatus, command_id: str, result: str) -> CanaryStatus:
    return replace(status, handled=(*status.handled, (command_id, result))[-HANDLED_KEPT:])


def _refuse(status: CanaryStatus, now: float, refusal: Refusal) -> Result:
    """Record a refused command: its own ledger record, a note on the running canary's."""
    cmd = refusal.command
    record_id = f"refused-{cmd.id}"
    tags = ledger.refusal_tags(record_id, str(cmd.kind), cmd.by, cmd.version, refusal.why, now)
    actions: list[Action] = [LedgerRefusal(record_id, now, tags)]
    if status.phase not in RESTING and status.canary_id:
        actions.append(LedgerNote(status.canary_id, f"rtrl.operator.{cmd.id}", tags[ledger.TAG_REASON]))
    return _note_handled(status, cmd.id, f"refused: {refusal.why}"), actions
