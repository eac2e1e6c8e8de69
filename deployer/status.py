"""The canary's vocabulary: the phase enum (a comment per value), the persisted status,
the policy it runs under and what the controller observes each tick.

The transition over them is deployer/canary.py; the status is persisted after every tick
(deployer/adapters/redis_state.py), so a restarted controller resumes where it stopped.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

from deployer.actions import Action
from deployer.routing import Holdout


class Phase(StrEnum):
    IDLE = "idle"  # no canary yet: the champion serves everyone; waiting for a candidate
    PENDING = "pending"  # candidate passed the gate; routing keys written with weight 0
    PROGRESSING = "progressing"  # weight steps up after each bake; the judge runs every tick
    AWAITING_APPROVAL = "awaiting_approval"  # passed the judge at the last step; holds its weight
    # until an operator approves (promote) or rejects it, the judge turns, or the wait times out
    PROMOTING = "promoting"  # decided to promote; moving aliases and routing to the candidate
    ROLLING_BACK = "rolling_back"  # weight already 0; removing the candidate, tagging, closing
    SUCCEEDED = "succeeded"  # rest: the candidate is the champion (previous = old champion)
    ROLLED_BACK = "rolled_back"  # rest: the candidate lost (judge, guardrail or operator)
    ABORTED = "aborted"  # rest: inconclusive at the budget, or repeated errors; not promoted


RESTING = frozenset({Phase.IDLE, Phase.SUCCEEDED, Phase.ROLLED_BACK, Phase.ABORTED})
"""Phases without a canary in flight: a new candidate may start."""
TRANSIENT = frozenset({Phase.PROMOTING, Phase.ROLLING_BACK})
"""Phases that finish on their next tick; the controller runs it at once."""
SOON = frozenset({Phase.PENDING})
"""Phases whose next tick should come within a second, not a whole tick later: routing is in
place at weight 0 and the candidate is being loaded into the engine; users reach it once a
tick sees it ready."""
JUDGED = frozenset({Phase.PROGRESSING, Phase.AWAITING_APPROVAL})
"""Phases in which the controller reads the cohorts and asks the judge every tick."""
RESULT_PHASE = {"promoted": Phase.SUCCEEDED, "rolled_back": Phase.ROLLED_BACK, "aborted": Phase.ABORTED}


@dataclass(frozen=True)
class CanaryPolicy:
    """How a canary progresses (built from DeployerSettings)."""

    steps: tuple[float, ...] = (0.01, 0.05, 0.25, 0.5)
    """Canary weights in order. Promotion is the final 100%: the candidate becomes stable."""
    bake_s: float = 600.0
    """Longest time a step waits for evidence: after it the canary steps up on a continuing
    verdict. A promote verdict steps up (or promotes from the last step) after ``min_bake_s``."""
    min_bake_s: float = 120.0
    """Least time on each step, whatever the evidence (capped at ``bake_s``): the guardrails
    and detectors see every weight for at least this long."""
    max_duration_s: float = 6 * 3600.0
    """Wall-clock cap: a canary still undecided after this long is aborted (inconclusive)."""
    budget_factor: float | None = 2.0
    """Budget in users: a canary still undecided once it has this many times the canary users
    its plan needs (rollback/plan.py; the largest need seen so far) is aborted as
    inconclusive. None: only the wall-clock cap and the judge's ``max_users`` end it."""
    max_errors: int = 5
    """Consecutive ticks whose observations failed before the canary is aborted."""
    approval_required: bool = False
    """A canary that passes the judge waits in awaiting_approval for an operator's approval."""
    approval_timeout_s: float = 24 * 3600.0
    """Longest wait for that approval; then the canary is rolled back (approval timed out)."""

    def __post_init__(self) -> None:
        if not self.steps:
            raise ValueError("canary steps must not be empty")
        if any(not 0 < w < 1 for w in self.steps):
            raise ValueError(f"canary steps must lie in (0, 1): {self.steps}; promotion is the 100% step")
        if list(self.steps) != sorted(set(self.steps)):
            raise ValueError(f"canary steps must increase strictly: {self.steps}")
        if self.bake_s < 0 or self.max_duration_s <= 0 or self.max_errors < 1:
            raise ValueError("bake_s >= 0, max_duration_s > 0 and max_errors >= 1 are required")
        if self.min_bake_s < 0:
            raise ValueError(f"min_bake_s must be >= 0, got {self.min_bake_s}")
        if self.budget_factor is not None and not self.budget_factor >= 1:
            raise ValueError(f"budget_factor must be >= 1 or None, got {self.budget_factor}")
        if self.approval_timeout_s <= 0:
            raise ValueError(f"approval_timeout_s must be > 0: {self.approval_timeout_s}")


@dataclass(frozen=True)
class Judgement:
    """The judge's verdict on the current cohorts, in the controller's terms."""

    decision: Literal["continue", "promote", "rollback", "inconclusive"]
    reasons: tuple[str, ...] = ()
    stats: Mapping[str, float] = field(default_factory=dict)
    """Flat statistics for the ledger and metrics, e.g. ``reward.effect``, ``reward.p_value``."""
    state: Mapping[str, Any] = field(default_factory=dict)
    """The judge's serialisable state to carry to the next tick."""
    judged_on: Mapping[str, Any] = field(default_factory=dict)
    """What the verdict was judged on besides the records (``deployer.cohorts.JudgedOn.to_doc``)."""
    plan: Mapping[str, Any] = field(default_factory=dict)
    """The canary's plan at this tick (``rollback.plan.CanaryPlan.to_doc``; empty: none)."""


@dataclass(frozen=True)
class Command:
    """An operator's request, queued by the CLI and handled on the controller's next tick.
    The deployer verifies its signature first (deployer/operators.py); the state machine
    sees only verified commands, with ``by`` = the verified operator."""

    id: str
    """Random; also the nonce that makes a copied command a replay."""
    kind: Literal["pause", "resume", "promote", "rollback", "approve", "holdout_pin", "holdout_rotate",
                  "holdout_end"]
    by: str
    version: str | None = None
    """promote / approve: the version; rollback: ``--to`` version (None: the canary); holdout
    pin / rotate: the version to pin (None: the champion)."""
    reason: str = ""
    share: float | None = None
    """holdout pin / rotate: share of users held out (None: the default or the current one)."""
    days: float | None = None
    """holdout pin / rotate: how long the holdout lasts (None: the default or the current one)."""
    ts: float = 0.0
    """When the operator signed it (Unix seconds)."""
    signature: str = ""
    """HMAC-SHA256 of the command under the operator's key, hex ('' when unsigned)."""


@dataclass(frozen=True)
class Refusal:
    """A queued command the deployer refused: who it claimed to be from, and why."""

    command: Command
    why: str


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
    """Verified operator commands."""
    refused: tuple[Refusal, ...] = ()
    """Commands whose signature, operator or age did not verify: recorded, never executed."""
    error: str | None = None
    """Set when reading observations failed (e.g. the rewards topic was unreachable)."""
    holdout: Holdout | None = None
    """The long-term holdout written in the routing table (expired or not)."""
    engine: Mapping[str, Any] | None = None
    """version -> deployer.engine.EngineState of versions on the inference engine; None when
    there is no engine (local policies): then nothing is loaded before traffic."""


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
    step_times: tuple[float, ...] = ()
    """When each weight step of this canary began, in order: the judge compares the arms only
    within a step (and a time bucket), so the ramp cannot bias the comparison."""
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
    judged_on: Mapping[str, Any] = field(default_factory=dict)
    """The latest verdict's inputs besides the records (``deployer.cohorts.JudgedOn``), for
    the ledger's decision record: ``rtrl replay`` judges the canary again from it."""
    plan: Mapping[str, Any] = field(default_factory=dict)
    """Users each primary metric needs and when they come (``rollback.plan``), latest tick."""
    budget_users: int = 0
    """The canary's budget in canary users (``CanaryPolicy.budget_factor`` × the largest need
    its plans have shown; 0: not planned yet)."""
    note: str = ""
    """Why the controller is waiting, e.g. a candidate that failed its gate."""
    handled: tuple[tuple[str, str], ...] = ()
    """(command id, result) of the latest operator commands, newest last."""

    def to_json(self) -> dict[str, Any]:
        out = {f: getattr(self, f) for f in self.__dataclass_fields__}
        out["phase"] = self.phase.value
        out["reasons"] = list(self.reasons)
        out["handled"] = [list(h) for h in self.handled]
        out["step_times"] = list(self.step_times)
        out["cohorts"], out["judge_state"] = dict(self.cohorts), dict(self.judge_state)
        out["judged_on"], out["plan"] = dict(self.judged_on), dict(self.plan)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CanaryStatus:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        known["phase"] = Phase(known.get("phase", "idle"))
        known["reasons"] = tuple(known.get("reasons", ()))
        known["handled"] = tuple((str(a), str(b)) for a, b in known.get("handled", ()))
        known["step_times"] = tuple(float(t) for t in known.get("step_times", ()))
        return cls(**known)


Result = tuple[CanaryStatus, list[Action]]
