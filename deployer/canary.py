"""The canary state machine: one pure transition over an explicit phase enum.

``next_state(status, observations, policy) -> (status, actions)`` is all the controller
decides; services/serve_deployer.py reads the observations, applies the actions through
adapters and persists the status after every tick, so a restarted controller resumes in
the phase it left. Each phase has its own small function below.

Lifecycle::

    idle ─candidate passed the gate─▶ pending ─routing set─▶ progressing (step weights, judge)
    progressing ─promote at last step─▶ promoting ─aliases moved─▶ succeeded
    progressing ─rollback / guardrail─▶ rolling_back ─────────────▶ rolled_back
    progressing ─inconclusive / budget / errors─▶ rolling_back ───▶ aborted

``paused`` is a flag, not a phase: it holds the weight and blocks promotion, never a rollback.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, Literal

from deployer import ledger
from deployer.actions import (
    Action,
    DeleteAlias,
    LedgerClose,
    LedgerOpen,
    LedgerStep,
    MoveAlias,
    SetRouting,
    SetWeight,
    WriteTags,
)
from deployer.registry import CANDIDATE, CHAMPION, PREVIOUS


class Phase(StrEnum):
    IDLE = "idle"  # no canary yet: the champion serves everyone; waiting for a candidate
    PENDING = "pending"  # candidate passed the gate; routing keys written with weight 0
    PROGRESSING = "progressing"  # weight steps up after each bake; the judge runs every tick
    PROMOTING = "promoting"  # decided to promote; moving aliases and routing to the candidate
    ROLLING_BACK = "rolling_back"  # weight already 0; removing the candidate, tagging, closing
    SUCCEEDED = "succeeded"  # rest: the candidate is the champion (previous = old champion)
    ROLLED_BACK = "rolled_back"  # rest: the candidate lost (judge, guardrail or operator)
    ABORTED = "aborted"  # rest: inconclusive at the budget, or repeated errors; not promoted


RESTING = frozenset({Phase.IDLE, Phase.SUCCEEDED, Phase.ROLLED_BACK, Phase.ABORTED})
"""Phases without a canary in flight: a new candidate may start."""
TRANSIENT = frozenset({Phase.PROMOTING, Phase.ROLLING_BACK})
"""Phases that finish on their next tick; the controller runs it at once."""
RESULT_PHASE = {"promoted": Phase.SUCCEEDED, "rolled_back": Phase.ROLLED_BACK, "aborted": Phase.ABORTED}


@dataclass(frozen=True)
class CanaryPolicy:
    """How a canary progresses (built from DeployerSettings)."""

    steps: tuple[float, ...] = (0.01, 0.05, 0.25, 0.5)
    """Canary weights in order. Promotion is the final 100%: the candidate becomes stable."""
    bake_s: float = 600.0
    """Least time on each step before moving on (and before promoting from the last)."""
    max_duration_s: float = 6 * 3600.0
    """Budget: a canary still undecided after this long is aborted (inconclusive)."""
    max_errors: int = 5
    """Consecutive ticks whose observations failed before the canary is aborted."""

    def __post_init__(self) -> None:
        if not self.steps:
            raise ValueError("canary steps must not be empty")
        if any(not 0 < w < 1 for w in self.steps):
            raise ValueError(f"canary steps must lie in (0, 1): {self.steps}; promotion is the 100% step")
        if list(self.steps) != sorted(set(self.steps)):
            raise ValueError(f"canary steps must increase strictly: {self.steps}")
        if self.bake_s < 0 or self.max_duration_s <= 0 or self.max_errors < 1:
            raise ValueError("bake_s >= 0, max_duration_s > 0 and max_errors >= 1 are required")


@dataclass(frozen=True)
class Judgement:
    """The judge's verdict on the current cohorts, in the controller's terms."""

    decision: Literal["continue", "promote", "rollback", "inconclusive"]
    reasons: tuple[str, ...] = ()
    stats: Mapping[str, float] = field(default_factory=dict)
    """Flat statistics for the ledger and metrics, e.g. ``reward.effect``, ``reward.p_value``."""
    state: Mapping[str, Any] = field(default_factory=dict)
    """The judge's serialisable state to carry to the next tick."""


@dataclass(frozen=True)
class Command:
    """An operator's request, queued by the CLI and handled on the controller's next tick."""

    id: str
    kind: Literal["pause", "resume", "promote", "rollback"]
    by: str
    version: str | None = None
    """promote: the version to promote; rollback: ``--to`` version (None: the canary)."""
    reason: str = ""


@dataclass(frozen=True)
class Observations:
    """What the controller saw this tick."""

    now: float
    champion: str | None
    candidate: str | None
    gate: Mapping[str, str] = field(default_factory=dict)
    """version -> rtrl.gate.result for the candidate and versions named by commands."""
    previous: str | None = None
    lineage: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    """version -> its lineage tags (parent, data window, reward spec, training run)."""
    judgement: Judgement | None = None
    """None: no verdict this tick (not progressing, or no cohort data yet)."""
    cohorts: Mapping[str, float] = field(default_factory=dict)
    """Cohort metrics for the ledger, e.g. ``stable.n``, ``canary.reward_mean``."""
    commands: tuple[Command, ...] = ()
    error: str | None = None
    """Set when reading observations failed (e.g. the rewards topic was unreachable)."""


@dataclass(frozen=True)
class CanaryStatus:
    """Everything the controller needs to resume; persisted as JSON after every tick."""

    phase: Phase = Phase.IDLE
    paused: bool = False
    kind: str = "canary"
    """canary | manual_promote | manual_rollback (an operator restoring an older champion)."""
    canary_id: str | None = None
    candidate: str | None = None
    stable: str | None = None
    """The champion when the canary started (the stable cohort's version)."""
    step: int = -1
    weight: float = 0.0
    started_at: float = 0.0
    phase_since: float = 0.0
    step_since: float = 0.0
    ticks: int = 0
    """Judged ticks of this canary (the ledger's step index)."""
    errors: int = 0
    """Consecutive ticks with an observation error."""
    outcome: str | None = None
    reason: str = ""
    decided_by: str | None = None
    verdict: str | None = None
    reasons: tuple[str, ...] = ()
    cohorts: Mapping[str, float] = field(default_factory=dict)
    judge_state: Mapping[str, Any] = field(default_factory=dict)
    note: str = ""
    """Why the controller is waiting, e.g. a candidate that failed its gate."""
    handled: tuple[tuple[str, str], ...] = ()
    """(command id, result) of the latest operator commands, newest last."""

    def to_json(self) -> dict[str, Any]:
        out = {f: getattr(self, f) for f in self.__dataclass_fields__}
        out["phase"] = self.phase.value
        out["reasons"] = list(self.reasons)
        out["handled"] = [list(h) for h in self.handled]
        out["cohorts"], out["judge_state"] = dict(self.cohorts), dict(self.judge_state)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CanaryStatus:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        known["phase"] = Phase(known.get("phase", "idle"))
        known["reasons"] = tuple(known.get("reasons", ()))
        known["handled"] = tuple((str(a), str(b)) for a, b in known.get("handled", ()))
        return cls(**known)


Result = tuple[CanaryStatus, list[Action]]
HANDLED_KEPT = 20


# ============================================================================ transition
def next_state(status: CanaryStatus, obs: Observations, policy: CanaryPolicy) -> Result:
    """The one transition: operator commands first, then the current phase's rule."""
    actions: list[Action] = []
    for cmd in obs.commands:
        if any(cmd.id == done for done, _ in status.handled):
            continue  # handled before a crash; the queue was not trimmed yet
        status, more, result = _command(status, obs, policy, cmd)
        status = replace(status, handled=(*status.handled, (cmd.id, result))[-HANDLED_KEPT:])
        actions += more
    status, more = PHASE_RULES[status.phase](status, obs, policy)
    return status, actions + more


def _enter(status: CanaryStatus, phase: Phase, now: float, **changes: Any) -> CanaryStatus:
    if phase == status.phase:
        return replace(status, **changes)
    return replace(status, phase=phase, phase_since=now, **changes)


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
    return _start(status, obs, policy, cand, kind="canary")


def _start(
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
    params = ledger.open_params(cand, stable, policy.steps, policy.bake_s, policy.max_duration_s)
    tags = ledger.open_tags(cid, kind, cand, stable, obs.lineage.get(cand, {}))
    actions: list[Action] = [LedgerOpen(cid, params, tags, now)]
    if kind == "canary":
        actions += [
            WriteTags(cand, {ledger.TAG_OUTCOME: ledger.OUTCOME_RUNNING, ledger.TAG_CANARY_ID: cid}),
            SetRouting(stable=stable, canary=cand, weight=0.0, salt=cid),
        ]
    return fresh, actions


# ---------------------------------------------------------------------------- pending
def _pending(status: CanaryStatus, obs: Observations, policy: CanaryPolicy) -> Result:
    """Routing is in place at weight 0: send the first step's share of users."""
    if obs.candidate != status.candidate:
        return _decide(status, obs.now, "aborted", _alias_moved(status, obs), ledger.CONTROLLER)
    if status.paused:
        return status, []
    w = policy.steps[0]
    return _enter(status, Phase.PROGRESSING, obs.now, step=0, weight=w, step_since=obs.now), [SetWeight(w)]


# ---------------------------------------------------------------------------- progressing
def _progressing(status: CanaryStatus, obs: Observations, policy: CanaryPolicy) -> Result:
    """Judge every tick; roll back at once on a losing verdict; step up after each bake;
    promote only from the last step, baked, on a promote verdict."""
    now = obs.now
    if obs.candidate != status.candidate:
        return _decide(status, now, "aborted", _alias_moved(status, obs), ledger.CONTROLLER)
    if obs.error is not None:
        return _on_error(status, obs, policy)
    status, actions = _record(replace(status, errors=0, note=""), obs)
    verdict = obs.judgement.decision if obs.judgement else "continue"
    if verdict == "rollback":
        return _decide(status, now, "rolled_back", _why(status, "judge: canary worse"), ledger.CONTROLLER,
                       actions)
    if verdict == "inconclusive":
        return _decide(status, now, "aborted", _why(status, "judge: inconclusive"), ledger.CONTROLLER,
                       actions)
    if now - status.started_at > policy.max_duration_s:
        reason = f"inconclusive: no decision within the {policy.max_duration_s:g}s budget"
        return _decide(status, now, "aborted", reason, ledger.CONTROLLER, actions)
    if status.paused or now - status.step_since < policy.bake_s:
        return status, actions
    if status.step + 1 < len(policy.steps):
        w = policy.steps[status.step + 1]
        return replace(status, step=status.step + 1, weight=w, step_since=now), [*actions, SetWeight(w)]
    if verdict == "promote":
        reason = _why(status, "judge: canary at least as good on every metric")
        return _decide(status, now, "promoted", reason, ledger.CONTROLLER, actions)
    return status, actions


def _record(status: CanaryStatus, obs: Observations) -> Result:
    """Keep the verdict in the status and write one ledger step for it."""
    j = obs.judgement
    if j is None:
        return replace(status, cohorts=dict(obs.cohorts) or status.cohorts), []
    step = status.ticks + 1
    status = replace(
        status, ticks=step, verdict=j.decision, reasons=tuple(j.reasons), judge_state=dict(j.state),
        cohorts=dict(obs.cohorts),
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
    return _decide(status, obs.now, "aborted", reason, ledger.CONTROLLER)


def _why(status: CanaryStatus, head: str) -> str:
    return head + (": " + "; ".join(status.reasons) if status.reasons else "")


def _alias_moved(status: CanaryStatus, obs: Observations) -> str:
    return f"candidate alias changed outside the controller (v{status.candidate} -> {obs.candidate})"


def _decide(
    status: CanaryStatus, now: float, outcome: str, reason: str, by: str, actions: list[Action] | None = None
) -> Result:
    """Enter promoting or rolling_back. A losing canary gets weight 0 in this very tick."""
    actions = list(actions or [])
    if outcome == "promoted":
        return _enter(status, Phase.PROMOTING, now, outcome=outcome, reason=reason, decided_by=by), actions
    actions.append(SetWeight(0.0))
    return _enter(status, Phase.ROLLING_BACK, now, outcome=outcome, reason=reason, decided_by=by,
                  weight=0.0), actions


# ---------------------------------------------------------------------------- finishing
def _promoting(status: CanaryStatus, obs: Observations, policy: CanaryPolicy) -> Result:
    """champion -> candidate, previous -> old champion, candidate alias removed, routing
    to the new champion at weight 0. Derived from the status only, so re-running is safe."""
    cand, old = status.candidate, status.stable
    assert cand is not None and status.canary_id is not None
    actions: list[Action] = [SetRouting(stable=cand, canary=None, weight=0.0, salt=status.canary_id)]
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
                             status.reasons, status.cohorts)
    if tagged is not None:
        actions.append(WriteTags(tagged, ledger.version_tags(cid, outcome, status.reason, by, now)))
    actions += [
        LedgerClose(cid, now, ledger.decision_tags(outcome, status.reason, by, now), summary),
    ]
    return _enter(status, RESULT_PHASE[outcome], now, weight=0.0, step=-1), actions


PHASE_RULES = {
    Phase.IDLE: _resting,
    Phase.SUCCEEDED: _resting,
    Phase.ROLLED_BACK: _resting,
    Phase.ABORTED: _resting,
    Phase.PENDING: _pending,
    Phase.PROGRESSING: _progressing,
    Phase.PROMOTING: _promoting,
    Phase.ROLLING_BACK: _rolling_back,
}


# ---------------------------------------------------------------------------- operators
def _command(
    status: CanaryStatus, obs: Observations, policy: CanaryPolicy, cmd: Command
) -> tuple[CanaryStatus, list[Action], str]:
    """Handle one operator command; returns the new status, actions and a result line."""
    from deployer.commands import handle

    return handle(status, obs, policy, cmd)
