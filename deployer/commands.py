"""Operator commands inside the state machine (pure): pause, resume, promote, rollback, approve.

The CLI queues a ``Command``; the controller hands it to ``next_state`` on its next tick, so
a manual decision goes through the same phases, actions and ledger as an automatic one,
with ``decided_by`` = the operator whose signature the deployer verified. Each command
yields a one-line result the CLI prints.
"""

from __future__ import annotations

from dataclasses import replace

from deployer import holdout
from deployer.actions import Action, LedgerNote
from deployer.status import RESTING, TRANSIENT, CanaryPolicy, CanaryStatus, Command, Observations, Phase
from deployer.transitions import decide, start

Handled = tuple[CanaryStatus, list[Action], str]


def handle(status: CanaryStatus, obs: Observations, policy: CanaryPolicy, cmd: Command) -> Handled:
    if cmd.kind in ("pause", "resume"):
        return _pause(status, cmd, cmd.kind == "pause")
    if cmd.kind in holdout.KINDS:  # independent of the canary: allowed in any phase
        actions, result = holdout.handle(obs, cmd)
        return status, actions, result
    if status.phase in TRANSIENT:
        return status, [], f"rejected: the canary of v{status.candidate} is finishing ({status.phase})"
    if cmd.kind == "approve":
        return _approve(status, obs, cmd)
    if cmd.kind == "promote":
        return _promote(status, obs, policy, cmd)
    return _rollback(status, obs, policy, cmd)


def _said(cmd: Command, head: str) -> str:
    return f"{head} by {cmd.by}" + (f": {cmd.reason}" if cmd.reason else "")


def _pause(status: CanaryStatus, cmd: Command, pause: bool) -> Handled:
    word = "paused" if pause else "resumed"
    if status.paused == pause:
        return status, [], f"already {word}"
    actions: list[Action] = []
    if status.phase not in RESTING and status.canary_id:
        actions.append(LedgerNote(status.canary_id, f"rtrl.operator.{cmd.id}", _said(cmd, word)))
    return replace(status, paused=pause), actions, word


def _approve(status: CanaryStatus, obs: Observations, cmd: Command) -> Handled:
    """Promote the canary that waits in awaiting_approval (and only that one)."""
    if status.phase != Phase.AWAITING_APPROVAL:
        return status, [], f"rejected: no canary awaits approval (phase {status.phase.value})"
    if cmd.version != status.candidate:
        return status, [], f"rejected: v{status.candidate} awaits approval, not v{cmd.version}"
    st, actions = decide(status, obs.now, "promoted", _said(cmd, "approved"), cmd.by)
    return st, actions, f"approved: promoting v{status.candidate}"


def _promote(status: CanaryStatus, obs: Observations, policy: CanaryPolicy, cmd: Command) -> Handled:
    version = cmd.version
    if version is None:
        return status, [], "rejected: promote needs a VERSION"
    if status.phase not in RESTING:
        if version != status.candidate:
            return status, [], (f"rejected: the canary of v{status.candidate} is in progress; "
                                "roll it back first (rtrl rollback)")
        st, actions = decide(status, obs.now, "promoted", _said(cmd, "promoted by hand"), cmd.by)
        return st, actions, f"promoting v{version}"
    refusal = _refuse_version(obs, version)
    if refusal:
        return status, [], refusal
    st, actions = start(status, obs, policy, version, kind="manual_promote")
    st = replace(st, outcome="promoted", reason=_said(cmd, "promoted by hand"), decided_by=cmd.by)
    return st, actions, f"promoting v{version}"


def _rollback(status: CanaryStatus, obs: Observations, policy: CanaryPolicy, cmd: Command) -> Handled:
    if status.phase not in RESTING:
        if cmd.version is not None:
            return status, [], (f"rejected: the canary of v{status.candidate} is in progress; roll it "
                                "back first (rtrl rollback), then rtrl rollback --to VERSION")
        st, actions = decide(status, obs.now, "rolled_back", _said(cmd, "rolled back by hand"), cmd.by)
        return st, actions, f"rolling back v{status.candidate}"
    target = cmd.version or obs.previous
    if target is None:
        return status, [], "rejected: no canary in progress and no previous version to roll back to"
    refusal = _refuse_version(obs, target)
    if refusal:
        return status, [], refusal
    reason = _said(cmd, f"champion v{obs.champion} rolled back to v{target} by hand")
    st, actions = start(status, obs, policy, target, kind="manual_rollback")
    st = replace(st, outcome="rolled_back", reason=reason, decided_by=cmd.by)
    return st, actions, f"rolling back the champion v{obs.champion} to v{target}"


def _refuse_version(obs: Observations, version: str) -> str:
    """Why ``version`` may not become the champion ('' when it may)."""
    if obs.champion is not None and version == obs.champion:
        return f"rejected: v{version} is already the champion"
    gate = obs.gate.get(version)
    if gate != "pass":
        return f"rejected: v{version} has gate result {gate or 'missing'}; only 'pass' is deployed"
    return ""

