"""One controller tick around the pure transition: decide, apply, persist, repeat while the
canary is finishing. Shared by the deployer service, the operator CLI and the unit tests."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from deployer.actions import Action
from deployer.canary import next_state
from deployer.status import TRANSIENT, CanaryPolicy, CanaryStatus, Observations


def tick(
    status: CanaryStatus,
    obs: Observations,
    policy: CanaryPolicy,
    apply: Callable[[list[Action]], None],
    persist: Callable[[CanaryStatus], None],
) -> CanaryStatus:
    """Run ``next_state`` and apply its actions, persisting the status after each
    transition. A decision (promoting / rolling_back) is finished in the same tick; the
    status is persisted in between, so a crash there resumes in the finishing phase, whose
    actions depend on the status alone and are idempotent."""
    for _ in range(3):
        status, actions = next_state(status, obs, policy)
        apply(actions)
        persist(status)
        if status.phase not in TRANSIENT:
            break
        obs = replace(obs, commands=(), judgement=None)
    return status
