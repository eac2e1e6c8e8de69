"""The offline gate: checks a candidate must pass before it may be canaried.

Held-out logged records (kept out of training by a hash of their request id) are scored
under the candidate and the parent. The checks are ones that stay honest for sequence
policies, where a whole-sequence importance ratio is a product of dozens of token ratios
and its variance explodes:

- **per-token truncated importance weights**: each token's ratio ``pi_cand / mu`` is
  truncated at ``truncate``; a completion's weight is the geometric mean of its truncated
  token ratios (1 for an empty completion). The self-normalised estimate of the candidate's
  reward ``sum w r / sum w`` gets a delta-method confidence interval, and the effective
  sample size ``(sum w)^2 / (n sum w^2)`` says how much of the sample it really rests on;
- **KL(parent || candidate)** in nats per completion with the non-negative k3 estimator
  ``(c/p - 1) - log(c/p)`` per token, weighted by ``min(pi_parent / mu, truncate)``;
- **no NaNs** in the candidate's log-probabilities or the training losses, and **loss
  sanity** (no training loss above ``max_abs_loss`` in magnitude).

The candidate fails when any check fails; the reward estimate fails it only when its upper
bound is clearly below the logged reward (``max_regression``) — the live canary, not this
estimate, decides promotion. With fewer than ``min_heldout`` records the estimate is
reported but not used.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer.mismatch import Mismatch


@dataclass(frozen=True)
class GateConfig:
    max_kl: float = 2.0
    min_kl: float = 1e-3
    """A candidate closer than this to its parent (nats per completion on the held-out records)
    did not move: its training kept no step (a KL band that backed off to where it started), and
    a canary of it would be an A/A test. 0: not checked."""
    min_ess: float = 0.2
    max_regression: float = 0.1
    truncate: float = 2.0
    z: float = 1.96
    min_heldout: int = 20
    max_abs_loss: float = 1e4
    max_mismatch: float = 0.1
    """Largest mean |log π_trainer − log π_engine| per token of the parent on the tokens it served
    (nats); above it the trainer is not training the model the engine serves. 0: not checked."""


@dataclass(frozen=True)
class HeldoutScore:
    """One held-out record scored under the candidate and the parent."""

    reward: float
    behavior: Sequence[float]
    candidate: Sequence[float]
    parent: Sequence[float]


@dataclass(frozen=True)
class GateResult:
    passed: bool
    reasons: list[str] = field(default_factory=list)
    """Why the candidate failed (empty when it passed)."""
    notes: list[str] = field(default_factory=list)
    """Checks that were not applied, and why."""
    figures: dict[str, float] = field(default_factory=dict)

    @property
    def result(self) -> str:
        return "pass" if self.passed else "fail"

    def reasons_json(self) -> str:
        return json.dumps({"reasons": self.reasons, "notes": self.notes, "figures": self.figures},
                          sort_keys=True)


def sequence_weight(candidate: Sequence[float], behavior: Sequence[float], truncate: float) -> float:
    """Geometric mean of the per-token truncated ratios ``min(exp(c - b), truncate)``."""
    if not candidate:
        return 1.0
    log_t = math.log(truncate)
    return math.exp(math.fsum(min(c - b, log_t) for c, b in zip(candidate, behavior, strict=True))
                    / len(candidate))


def snips_estimate(
    weights: Sequence[float], rewards: Sequence[float], z: float
) -> tuple[float, float, float, float]:
    """Self-normalised importance-weighted mean with a delta-method interval:
    ``(estimate, low, high, ess_fraction)``."""
    n = len(weights)
    sw = math.fsum(weights)
    if n == 0 or sw <= 0:
        return math.nan, math.nan, math.nan, 0.0
    est = math.fsum(w * r for w, r in zip(weights, rewards, strict=True)) / sw
    se = math.sqrt(math.fsum(w * w * (r - est) ** 2 for w, r in zip(weights, rewards, strict=True))) / sw
    ess = sw**2 / (n * math.fsum(w * w for w in weights))
    return est, est - z * se, est + z * se, ess


def kl_parent_candidate(
    parent: Sequence[float], candidate: Sequence[float], behavior: Sequence[float], truncate: float
) -> float:
    """k3 estimate of KL(parent || candidate) for one completion, importance-weighted from
    the behavior policy to the parent (weights truncated)."""
    total = 0.0
    for p, c, b in zip(parent, candidate, behavior, strict=True):
        w = min(math.exp(p - b), truncate)
        d = c - p
        total += w * (math.expm1(d) - d)
    return total


def mismatch_check(found: Mismatch | None, bound: float, reasons: list[str], notes: list[str]) -> None:
    """The parent's train-inference mismatch against its bound (None or bound 0: not checked)."""
    if found is None or bound <= 0:
        return
    if found.tokens == 0:
        notes.append("no records served by the parent: train-inference mismatch not measured")
    elif not found.mean_abs <= bound:
        reasons.append(f"train-inference mismatch of the parent {found.mean_abs:.3g} nats/token (p99 "
                       f"{found.p99_abs:.3g}) exceeds {bound:g}: the trainer is not scoring what the "
                       "engine served (another model, tokenizer or chat template, or sampling the "
                       "events do not record: top-p/top-k, a minimum length, a temperature left out)")


def evaluate(
    scores: Sequence[HeldoutScore], train_losses: Sequence[float], cfg: GateConfig,
    mismatch: Mismatch | None = None,
) -> GateResult:
    reasons: list[str] = []
    notes: list[str] = []
    figures: dict[str, float] = {"heldout": float(len(scores))}
    mismatch_check(mismatch, cfg.max_mismatch, reasons, notes)

    bad_losses = [x for x in train_losses if not math.isfinite(x)]
    if bad_losses:
        reasons.append(f"non-finite training loss ({len(bad_losses)} steps)")
    elif train_losses and max(abs(x) for x in train_losses) > cfg.max_abs_loss:
        reasons.append(f"training loss above {cfg.max_abs_loss:g} in magnitude")
    if train_losses:
        figures["final_loss"] = float(train_losses[-1])
    if any(not math.isfinite(v) for s in scores for v in s.candidate):
        reasons.append("non-finite candidate log-probabilities on held-out records")
        return GateResult(False, reasons, notes, figures)
    if not scores:
        notes.append("no held-out records: reward estimate and KL not checked")
        return GateResult(not reasons, reasons, notes, figures)

    kls = [kl_parent_candidate(s.parent, s.candidate, s.behavior, cfg.truncate) for s in scores]
    kl = math.fsum(kls) / len(kls)
    figures["kl_parent"] = kl
    reasons += kl_check(kl, cfg)

    rewards = [s.reward for s in scores]
    weights = [sequence_weight(s.candidate, s.behavior, cfg.truncate) for s in scores]
    est, lo, hi, ess = snips_estimate(weights, rewards, cfg.z)
    baseline = math.fsum(rewards) / len(rewards)
    figures.update(baseline_reward=baseline, estimate=est, ci_low=lo, ci_high=hi, ess=ess)
    if len(scores) < cfg.min_heldout:
        notes.append(f"only {len(scores)} held-out records (< {cfg.min_heldout}): estimate not used")
    else:
        if ess < cfg.min_ess:
            reasons.append(f"effective sample size {ess:.3f} below {cfg.min_ess:g}: candidate far off-policy")
        if hi < baseline - cfg.max_regression:
            reasons.append(
                f"estimated reward {est:.3f} (CI {lo:.3f}..{hi:.3f}) clearly below logged {baseline:.3f}"
            )
    return GateResult(not reasons, reasons, notes, figures)


def kl_check(kl: float, cfg: GateConfig) -> list[str]:
    """Why the candidate's KL to its parent fails it: over the budget, or so small that the
    candidate is its parent (empty: it passes)."""
    if not math.isfinite(kl) or kl > cfg.max_kl:
        return [f"KL to parent {kl:.3g} nats/completion exceeds budget {cfg.max_kl:g}"]
    if kl < cfg.min_kl:
        return [f"KL to parent {kl:.3g} nats/completion below {cfg.min_kl:g}: "
                "training kept no step, the candidate is its parent"]
    return []


def gate_words(gate: GateResult, parent: str) -> list[str]:
    """The offline gate against the parent in words, one line per check it made, then why it
    failed and what it could not check."""
    f = gate.figures
    lines = [f"Offline gate against v{parent}: **{'passed' if gate.passed else 'failed'}**."]
    if "kl_parent" in f:
        lines.append(f"- KL from v{parent}: {f['kl_parent']:.3g} nats per completion (held-out records).")
    if {"estimate", "ci_low", "ci_high", "baseline_reward"} <= f.keys():
        lo, hi, base = f["ci_low"], f["ci_high"], f["baseline_reward"]
        verdict = "better" if lo > base else "worse" if hi < base else "no clear difference"
        lines.append(f"- Reward on the held-out records, estimated for this candidate: {f['estimate']:.3f} "
                     f"(interval {lo:.3f} to {hi:.3f}) against {base:.3f} as served: {verdict}.")
    if "ess" in f:
        lines.append(f"- Effective sample size of that estimate: {f['ess']:.2f} (1 is on-policy).")
    lines += [f"- Failed: {r}." for r in gate.reasons] + [f"- Not checked: {n}." for n in gate.notes]
    return lines
