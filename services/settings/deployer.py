"""The deployer's settings (``rtrl serve deployer``): the canary's schedule and budget, the
judge's knobs and the approval gate. Composed into the settings tree by
services/settings/model.py; nothing here reads the environment.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from services.settings.operators import ApprovalSettings
from services.settings.services import Section


class DeployerSettings(Section):
    """``rtrl serve deployer``: the canary controller, its schedule and the judge's knobs."""

    tick_s: Annotated[float, Field(gt=0.0)] = 30.0
    """Seconds between controller ticks (read status, judge, act, persist)."""
    steps: tuple[float, ...] = (0.01, 0.05, 0.25, 0.5)
    """Canary weights in order, each in (0, 1). Promotion is the final 100% (the candidate
    becomes the stable version), so 1.0 is not listed. Env: RTRL_DEPLOYER__STEPS='[0.01,0.1]'."""
    bake_s: Annotated[float, Field(ge=0.0)] = 600.0
    """Longest seconds a step waits for evidence: after it the canary steps up on a continuing
    verdict. A promote verdict (every primary metric already shown no worse) steps up, or
    promotes from the last step, after ``min_bake_s``."""
    min_bake_s: Annotated[float, Field(ge=0.0)] = 120.0
    """Least seconds on each step whatever the evidence (capped at ``bake_s``): the guardrails
    and detectors see every weight for at least this long."""
    max_duration_s: Annotated[float, Field(gt=0.0)] = 6 * 3600.0
    """Wall-clock cap of one canary; still undecided after it, the canary is aborted
    (inconclusive)."""
    budget_factor: Annotated[float, Field(ge=1.0)] | None = 2.0
    """Budget in users: a canary still undecided once each undecided primary metric has this
    many times the canary users its plan needs is aborted (inconclusive); the budget is shown
    by ``rtrl status`` and written to the ledger. null: only the wall-clock cap and
    ``judge_max_users`` end a canary."""
    engine_check_tolerance: Annotated[float, Field(gt=0.0)] = 0.05
    """With an inference engine: the largest |log-probability difference| (nats) allowed
    between the engine and the candidate's own on the fixed check prompt before it serves."""
    max_errors: Annotated[int, Field(ge=1)] = 5
    """Consecutive ticks whose observations failed before the canary is aborted."""
    lease_ttl_s: Annotated[float, Field(gt=0.0)] = 90.0
    """The controller lease in Redis expires this long after the last renewal, so a killed
    controller's successor takes over after at most this long (keep it > 2 x tick_s)."""
    judge_alpha: Annotated[float, Field(gt=0.0, lt=0.5)] = 0.01
    """The judge's false-rollback rate for an A/A canary, checked at every tick."""
    judge_min_users: Annotated[int, Field(ge=1)] = 200
    """No promotion before each arm has this many users (and no statistical decision but a
    confident regression, from judge_rollback_min_users)."""
    judge_rollback_min_users: Annotated[int, Field(ge=1)] = 100
    """A confident regression rolls back from this many users per arm (capped at
    judge_min_users), judged on the larger per-user variance of the two arms until then."""
    judge_max_users: Annotated[int, Field(ge=1)] = 20_000
    """Sample budget in users per arm; spent without a decision, the canary is aborted."""
    judge_max_error_rate: Annotated[float, Field(gt=0.0, le=1.0)] = 0.05
    """Guardrail: the canary's error-rate ceiling (rolls back at once)."""
    judge_max_p99_latency_ms: Annotated[float, Field(gt=0.0)] = 10_000.0
    """Guardrail: the canary's p99 latency ceiling in ms (rolls back at once)."""
    judge_min_requests: Annotated[int, Field(ge=1)] = 1
    """A floor of canary requests before a guardrail may act. The guardrails' own
    anytime-valid test already waits for enough evidence (docs/judge.md), so 1 adds nothing."""
    judge_stratum_s: Annotated[float, Field(gt=0.0)] = 600.0
    """Width of the judge's time strata: arms are compared only within one stratum and one
    weight step, so a drift shared by both arms cannot look like an effect."""
    judge_user_weight_cap: Annotated[float, Field(ge=1.0)] | None = 10.0
    """A user's requests count at most this many times in a judged metric (heavy users cannot
    drown the others); null: no cap."""
    judge_tail_cap_quantile: Annotated[float, Field(gt=0.5, lt=1.0)] | None = 0.999
    """Continuous metrics (latency, reward, completion length) are judged with each request
    clipped to the [1 - q, q] quantiles of both arms pooled, so a heavy tail cannot keep a
    mean's interval wide (latency's tail has latency_tail and the p99 guardrail); null: plain
    means."""
    judge_require_improvement: bool = False
    """Promote only a canary that is confidently better on at least one primary metric (and
    no worse than its MDE on every other). false: "no worse" on every primary metric is enough,
    so a chain of promotions can give back up to an MDE at each step."""
    judge_mde: dict[str, float] = Field(default_factory=dict)
    """Minimum detectable effect per judged metric, overriding the judge's defaults (see
    docs/judge.md), e.g. RTRL_DEPLOYER__JUDGE_MDE='{"reward": 0.1, "persistence": 0.05}'."""
    poll_timeout_ms: Annotated[int, Field(ge=1)] = 500
    """Longest wait between two polls of the rewards topic within one tick (a tick stops
    reading after three empty polls, 30 ms apart in all)."""
    lag_interval_s: Annotated[float, Field(ge=0.0)] = 30.0
    """Seconds between reads of the ingest and reward groups' lag from the broker
    (``rtrl_group_lag_seconds``, which outlives the consumers); 0 turns them off."""
    holdout_every_s: Annotated[float, Field(ge=0.0)] = 60.0
    """Seconds between measurements of the champion against the long-term holdout (while one
    is pinned: ``rtrl holdout``, docs/holdout.md); 0 turns them off."""
    approval: ApprovalSettings = ApprovalSettings()
    """The approval gate (services/settings/operators.py)."""
