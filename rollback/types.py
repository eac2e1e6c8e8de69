"""What the rollback judge reads and what it answers.

The deployer fills one :class:`CohortData` per arm (stable, canary) over the same time
window — one :class:`RequestOutcome` per closed reward record, plus the gateway's request
and error counts for that arm — and calls :func:`rollback.judge.judge` every tick. The
answer is a :class:`Verdict`: a decision, plain-English reasons with numbers, and the
evidence per metric, guardrail and reward-hacking detector, ready for the ledger.
Everything is a frozen dataclass of plain values: verdicts log as JSON, and the judge's
sequential state (a ``dict[str, float]``) persists with the deployer.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Literal

import numpy as np
from numpy.typing import NDArray

from ingest.contracts.metrics import PERSISTENCE_HORIZON_S

CompletionKind = Literal["edit", "question", "empty", "tool_call"]  # as ingest.events.CompletionKind
Direction = Literal["higher_is_better", "lower_is_better"]
Status = Literal["worse", "non_inferior", "better", "undecided", "insufficient"]
JudgeState = dict[str, float]
"""Sequential state carried between ticks (running minima of always-valid p-values and a
tick counter). The deployer persists it as JSON and passes it back on the next tick."""


class Decision(StrEnum):
    """What the deployer should do after this tick."""

    CONTINUE = "continue"
    """Not enough evidence either way yet: keep the canary at its current step."""
    PROMOTE = "promote"
    """Every primary metric is, with confidence, no worse than its minimum detectable effect,
    no guardrail or detector fired: the candidate may advance / be promoted."""
    ROLLBACK = "rollback"
    """A guardrail tripped, a primary metric is confidently worse, or a reward-hacking
    detector found drift: roll the canary back now."""
    INCONCLUSIVE = "inconclusive"
    """The sample or time budget ran out without a decision: abort, never promote."""


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    """One served request and what users did with it (built from a RewardRecord)."""

    user_key: str
    """Pseudonymous user: the unit of randomisation and of analysis (requests are clustered by it)."""
    reward: float
    """The reward the spec assigned."""
    latency_ms: float
    """Serving latency of this completion."""
    persistence: float | None = None
    """Retained/inserted ratio of the accepted edit at the judged horizon; None when not observed."""
    accepted: bool | None = None
    """True accepted, False rejected, None no accept/reject feedback."""
    error: bool = False
    """True when serving failed (usually errors arrive as counts in CohortData instead)."""
    dissatisfied: int = 0
    """Number of dissatisfied follow-ups to this request."""
    completion_kind: CompletionKind = "edit"
    """What the completion was: a proposed edit, a clarifying question, or nothing."""
    tool_calls: int = 0  # tool calls the completion made
    invalid_tool_calls: int = 0  # of which invalid (malformed, unknown tool, bad arguments)
    completion_tokens: int = 0  # completion length in tokens
    session_turns: int = 0  # at an agent session's lead request (CreditedSession.lead): its turns,
    session_completed: bool = False  # whether it completed
    session_invalid: bool = False  # and whether it made an invalid tool call (else 0, False, False)
    ts: float = 0.0
    """When it was served (Unix seconds): places the request in its time stratum. Outcomes
    that all carry the same ts (e.g. the default 0) fall in one stratum."""


@dataclass(frozen=True, slots=True)
class ErrorCount:
    """Requests the gateway failed for one user in one time bucket."""

    user_key: str
    ts: float
    """Start of the bucket the errors fell in (Unix seconds)."""
    count: int


@dataclass(frozen=True, eq=False)
class Columns:
    """One arm's outcomes as one array per field, in order (built by rollback/columns.py, which
    says what each holds). ``user`` indexes ``user_keys``, users in order of first appearance."""

    user: NDArray[np.int64]
    user_keys: tuple[str, ...]
    kind: NDArray[np.int8]
    ts: NDArray[np.float64]
    reward: NDArray[np.float64]
    latency_ms: NDArray[np.float64]
    persistence: NDArray[np.float64]
    accepted: NDArray[np.float64]
    dissatisfied: NDArray[np.float64]
    tool_calls: NDArray[np.float64]
    invalid_tool_calls: NDArray[np.float64]
    completion_tokens: NDArray[np.float64]
    session: NDArray[np.float64]
    session_completed: NDArray[np.float64]
    completed_turns: NDArray[np.float64]
    session_broken: NDArray[np.float64]
    has_persistence: NDArray[np.bool_]
    has_accepted: NDArray[np.bool_]
    error: NDArray[np.bool_]

    @property
    def users(self) -> int:
        return len(self.user_keys)


@dataclass(frozen=True, slots=True)
class CohortData:
    """One arm's observations over the judged window."""

    arm: Literal["stable", "canary"]
    """Which arm these observations come from."""
    outcomes: tuple[RequestOutcome, ...] = ()
    """Closed reward records of the window, one per request."""
    requests: int = 0
    """Requests the gateway served for this arm in the window (denominator of the error rate).
    When 0, the number of outcomes is used."""
    errors: int = 0
    """Requests the gateway failed for this arm in the window (counted at the gateway, since a
    failed request never produces a reward record). Outcomes with ``error=True`` are added."""
    user_errors: tuple[ErrorCount, ...] = ()
    """The same failures by user and time, so that the error rate is clustered by user like
    every other metric (one user's burst of retries is one user's evidence). Errors counted in
    ``errors`` but missing here are treated as one user each."""
    columns: Columns | None = field(default=None, compare=False, repr=False)
    """The outcomes as columns, when the caller keeps them (the deployer's window does)."""

    def request_count(self) -> int:
        return max(self.requests, len(self.outcomes))

    def error_count(self) -> int:
        if self.columns is not None:
            return self.errors + int(self.columns.error.sum())
        return self.errors + sum(1 for o in self.outcomes if o.error)

    def unattributed_errors(self) -> int:
        """Errors known only as a count, without the user they failed for."""
        return max(0, self.error_count() - sum(e.count for e in self.user_errors))

    def users(self) -> int:
        if self.columns is not None:
            return self.columns.users
        return len({o.user_key for o in self.outcomes})


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """A metric the judge tests sequentially, and how large a change matters."""

    name: str
    """One of rollback.metrics.METRICS (persistence, acceptance, reward, latency_ms,
    latency_tail, dissatisfied, error_rate) or a detector name."""
    mde: float
    """Minimum detectable effect, absolute, in the metric's units (e.g. 0.03 = 3 points of
    persistence, 50 = 50 ms). It sets the mixture scale of the test (power is tuned for it)
    and the non-inferiority margin promotion requires."""
    direction: Direction = "higher_is_better"
    """Which way is better for the product."""
    primary: bool = True
    """Primary metrics must be non-inferior for promotion; all listed metrics can roll back."""


GUARDRAILS = ("error_rate", "p99_latency_ms")


@dataclass(frozen=True, slots=True)
class GuardrailPolicy:
    """Absolute ceilings that roll back at once, without waiting for a test."""

    max_error_rate: float = 0.05
    """Roll back when the canary's error rate is confidently over this (and over stable's)."""
    max_p99_latency_ms: float = 10_000.0
    """Roll back when the canary's p99 latency is confidently over this (and over stable's):
    more than 1% of its requests confidently took longer."""
    min_requests: int = 1
    """A floor on the canary's requests before a guardrail may act. The guardrails' own test
    already waits for enough data (a p99 needs hundreds of requests to be confidently over a
    ceiling, a canary failing everything a handful), so the default adds nothing."""


@dataclass(frozen=True, slots=True)
class DetectorPolicy:
    """Reward-hacking detectors: drift in behaviour rates between canary and stable."""

    edit_rate_drop: float = 0.05
    """Tolerated fall in the share of completions that are edits (absolute). A confident fall
    beyond it means the model dodges edits (asks questions or says nothing) — rollback."""
    question_rate_rise: float = 0.05
    """Tolerated rise in the share of completions that are clarifying questions (absolute)."""
    abstention_rate_rise: float = 0.03
    """Tolerated rise in the share of empty completions (absolute)."""
    invalid_tool_rate_rise: float = 0.02
    """Tolerated rise in the share of tool calls that are invalid (absolute)."""
    length_change: float = 0.25
    """Tolerated relative change of mean completion length either way (0.25 = ±25% of stable)."""
    enabled: tuple[str, ...] = (
        "edit_rate", "question_rate", "abstention_rate", "invalid_tool_rate", "completion_length",
    )
    """Which detectors run."""


def default_metrics() -> tuple[MetricSpec, ...]:
    return (
        MetricSpec("persistence", 0.03, "higher_is_better"),
        MetricSpec("acceptance", 0.03, "higher_is_better"),
        MetricSpec("reward", 0.05, "higher_is_better"),
        MetricSpec("latency_ms", 100.0, "lower_is_better"),
        MetricSpec("latency_tail", 0.02, "lower_is_better", primary=False),
        MetricSpec("dissatisfied", 0.02, "lower_is_better"),
        MetricSpec("error_rate", 0.01, "lower_is_better", primary=False),
    )


@dataclass(frozen=True, slots=True)
class JudgePolicy:
    """How the judge decides. Defaults suit a canary of a few thousand users per arm."""

    alpha: float = 0.01
    """Target false-rollback rate of an A/A canary, checked at every tick. It is split evenly
    (Bonferroni) across every sequential test that can roll back: metrics and detectors."""
    metrics: tuple[MetricSpec, ...] = field(default_factory=default_metrics)
    """Metrics tested sequentially (always-valid confidence sequences on canary − stable)."""
    min_users: int = 200
    """No promotion before each arm has this many users (the variance estimate and the normal
    approximation need them), and no statistical decision but a confident regression (from
    ``rollback_min_users``). Guardrails do not wait for it."""
    rollback_min_users: int = 100
    """A metric may roll back (confidently worse) from this many users per arm (capped at
    ``min_users``); until ``min_users`` each arm's variance is floored by the larger per-user
    variance of the two, and nothing else is decided. A clear regression is then rolled back
    at its evidence, not at the promote floor."""
    max_users: int = 20_000
    """Sample budget: users per arm (the smaller counts). Reached undecided: inconclusive."""
    max_duration_s: float = 6 * 3600.0
    """Time budget: seconds since the canary started. Reached without a decision: inconclusive."""
    require_improvement: bool = False
    """If True, promotion also needs at least one primary metric confidently better."""
    stratum_s: float = 600.0
    """Width of the time strata (s). Arms are compared only within a stratum and a weight step,
    so a drift shared by both arms cannot look like an effect."""
    user_weight_cap: float | None = 10.0
    """A user's requests count at most this many times in a metric (their mean keeps its value,
    their weight is capped), so a few heavy users cannot drown the others. None: no cap."""
    mixture_scale: float = 1.0
    """The mSPRT mixture's sd is mixture_scale × MDE; 1.0: most sensitive near the MDE."""
    persistence_horizon_s: int = PERSISTENCE_HORIZON_S
    """The horizon edit persistence is judged at: the reward spec's primary one."""
    tail_cap_quantile: float | None = 0.999
    """Continuous metrics (latency, reward, completion length) are compared with each value
    clipped to the [1 − q, q] quantiles of both arms pooled (winsorized; None: plain means),
    so a heavy tail cannot keep a mean's interval wide for hours. Latency's tail itself is
    judged by ``latency_tail`` and the p99 guardrail."""
    guardrails: GuardrailPolicy = field(default_factory=GuardrailPolicy)
    """Absolute ceilings that roll back immediately."""
    detectors: DetectorPolicy = field(default_factory=DetectorPolicy)  # reward-hacking detectors

    def __post_init__(self) -> None:
        if not 0 < self.alpha < 1:
            raise ValueError(f"alpha must be in (0, 1), got {self.alpha}")
        if not self.stratum_s > 0:
            raise ValueError(f"stratum_s must be > 0, got {self.stratum_s}")
        if self.user_weight_cap is not None and not self.user_weight_cap >= 1:
            raise ValueError(f"user_weight_cap must be >= 1 or None, got {self.user_weight_cap}")
        if self.tail_cap_quantile is not None and not 0.5 < self.tail_cap_quantile < 1:
            raise ValueError(f"tail_cap_quantile must be in (0.5, 1) or None, got {self.tail_cap_quantile}")
        if self.mixture_scale <= 0:
            raise ValueError(f"mixture_scale must be > 0, got {self.mixture_scale}")
        if self.rollback_min_users < 1:
            raise ValueError(f"rollback_min_users must be >= 1, got {self.rollback_min_users}")
        if not 1 <= self.min_users <= self.max_users:
            raise ValueError(f"need 1 <= min_users <= max_users, got {self.min_users}, {self.max_users}")
        bad = [m.name for m in self.metrics if not m.mde > 0]
        if bad:
            raise ValueError(f"every metric needs a positive mde; check {bad}")
        names = [m.name for m in self.metrics]
        if len(set(names)) != len(names):
            raise ValueError(f"metrics listed twice: {names}")

    def n_tests(self) -> int:
        """Number of sequential tests sharing alpha: metrics, detectors and the two guardrails."""
        return len(self.metrics) + len(self.detectors.enabled) + len(GUARDRAILS)

    def alpha_per_test(self) -> float:
        return self.alpha / max(1, self.n_tests())


@dataclass(frozen=True, slots=True)
class MetricEvidence:
    """The judge's statistics for one metric (or detector) at this tick: canary − stable."""

    metric: str
    direction: Direction
    stable_mean: float
    canary_mean: float
    estimate: float  # canary − stable
    ci_lower: float
    """Always-valid lower confidence bound on canary − stable (at the per-test level)."""
    ci_upper: float
    p_value: float
    """Always-valid p-value for "no difference" (running minimum over ticks)."""
    n_stable: int
    """Users (clusters) in stable contributing to this metric (requests for error_rate)."""
    n_canary: int
    mde: float
    """Minimum detectable effect / tolerance (absolute) for this metric."""
    status: Status
    """worse: confidently worse (rolls back); non_inferior: confidently no worse than −MDE;
    better: confidently better; undecided: none of these yet; insufficient: too few samples."""
    var_stable: float = math.nan
    var_canary: float = math.nan
    """Variance of each arm's mean (stratified, user-clustered): what rollback/plan.py projects."""


@dataclass(frozen=True, slots=True)
class GuardrailResult:
    name: str
    """error_rate or p99_latency_ms."""
    canary_value: float
    stable_value: float
    ceiling: float
    tripped: bool
    exceeding: int = 0
    """Canary requests over the ceiling (failed ones for the error rate)."""
    requests: int = 0
    """Canary requests the guardrail looked at."""
    evidence: float = 1.0
    """The anytime-valid likelihood ratio against "the canary is within the ceiling"; the
    guardrail trips once it reaches 1/α for its share of the error budget."""


@dataclass(frozen=True, slots=True)
class DetectorResult:
    name: str
    """edit_rate, question_rate, abstention_rate, invalid_tool_rate, completion_length."""
    evidence: MetricEvidence
    fired: bool
    """Confident drift beyond the tolerance in the suspicious direction: rollback."""
    holding: bool
    """The point estimate is beyond the tolerance but not yet confidently: blocks promotion."""
    explanation: str


@dataclass(frozen=True, slots=True)
class Verdict:
    decision: Decision
    reasons: tuple[str, ...]
    """Plain-English sentences with numbers, most important first."""
    metrics: tuple[MetricEvidence, ...]
    guardrails: tuple[GuardrailResult, ...]
    detectors: tuple[DetectorResult, ...]
    users_stable: int
    users_canary: int
    state: JudgeState
    """Pass this back on the next tick (and persist it)."""

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form for the ledger (strict JSON: undefined bounds become None)."""
        out = _finite(asdict(self))
        assert isinstance(out, dict)
        return out

    def stats(self) -> dict[str, float]:
        """Flat ``<metric>.<stat>`` -> value map (for MLflow metrics and the JUDGE_STAT gauge).
        Values not yet defined (an unbounded interval before ``min_users``) are left out."""
        out: dict[str, float] = {}
        for ev in (*self.metrics, *(d.evidence for d in self.detectors)):
            for stat in ("stable_mean", "canary_mean", "estimate", "ci_lower", "ci_upper", "p_value"):
                value = float(getattr(ev, stat))
                if math.isfinite(value):
                    out[f"{ev.metric}.{stat}"] = value
        return out


def _finite(x: object) -> object:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x
