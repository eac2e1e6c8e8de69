"""A steady step: each increment aims at a KL to its parent inside a set band.

One increment's step used to vary a lot with the same settings (the KL to the parent of ten
single increments from one bootstrap ranged from 1.2 to 4.7 nats), so some candidates moved
too little to matter and others so far that the canary's reward-hacking detectors or the
offline gate threw them out. The band turns the step size into a setting:

- every ``probe_every`` steps the policy is scored on a probe set, and KL(parent || policy)
  per completion is estimated there the way the offline gate estimates it (k3 per token,
  weighted by the truncated parent/behaviour ratio, summed over the completion). The increment
  probes the gate's own held-out records (up to ``probe_size``), so the band aims at the KL
  the gate will measure; without them a probe set is split off the window's samples by the
  seed and kept out of training;
- at or above the band's **target** (its midpoint unless set) the increment stops;
- above the band's **high** edge the last step was too big: the policy and optimiser go back
  to the last probe inside the band, the learning rate is halved and training goes on (at most
  ``max_backoffs`` times; after that the increment stops at the restored state);
- below the target, training goes on, over up to ``max_epochs`` passes of the window; a window
  exhausted below ``low`` ends the increment there (recorded, not an error: the gate and the
  canary still decide);
- after a back-off, a probe whose KL is no higher than the kept state's made no progress
  towards the target: after ``stall_probes`` such probes in a row the increment **stalled**
  and stops at the kept state (the furthest it got inside the band). At a halved or quartered
  rate the probes' KL can fall instead of rising, and without this rule such an increment
  crawled over its whole window (on the vLLM demo 17-18 minutes, 190-240 steps, ending below
  where it had been);
- with a **length guard** (``max_length_change``), each probe also samples completions from the
  policy for up to ``length_probe_size`` probe prompts (fixed seeds, the same for the parent, so
  the two samples differ only by the policy) and a step that changed the mean completion length
  by more than that fraction counts as an overshoot too. The KL alone cannot tell a step that
  shortened answers by 30% (which the canary's length detector rolls back) from one that
  shortened them by 10%: both land in the same band.

:func:`decide` is the rule as a pure function; :class:`Probe` holds the probe set's parent
log-probabilities (computed once) and scores the policy.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from trainer.objective import importance_weights, k3_tokens, padded

if TYPE_CHECKING:
    from trainer.objective import Sample
    from trainer.policy import TrainablePolicy


@dataclass(frozen=True)
class KLBand:
    """The KL(parent || candidate) an increment aims at, in nats per completion."""

    low: float
    high: float
    probe_every: int = 4
    """Steps between probes."""
    probe_size: int = 512
    """Most records in the probe set (the gate's held-out records, or samples split off the
    window by the seed)."""
    max_epochs: int = 3
    """Most passes over the window while the KL is below the target."""
    max_backoffs: int = 3
    """Most overshoots (each halves the learning rate) before the increment stops."""
    max_length_change: float | None = None
    """Largest relative change of the mean sampled completion length before a step counts as
    an overshoot (None: no length guard)."""
    length_probe_size: int = 128
    """Probe prompts the length guard samples a completion for."""
    target_kl: float | None = None
    """Where training stops (None: the band's midpoint)."""
    stall_probes: int | None = 2
    """Probes in a row after a back-off that bring the KL no higher than the kept state's before
    the increment stops there (None: train on, over the whole window)."""

    def __post_init__(self) -> None:
        if not (0.0 <= self.low < self.high and math.isfinite(self.high)):
            raise ValueError(f"KL band needs 0 <= low < high < inf, got [{self.low}, {self.high}]")
        if self.probe_every < 1 or self.probe_size < 1 or self.max_epochs < 1 or self.max_backoffs < 0:
            raise ValueError("KL band: probe_every, probe_size and max_epochs must be >= 1, "
                             "max_backoffs >= 0")
        if self.max_length_change is not None and not 0.0 < self.max_length_change < 1.0:
            raise ValueError(f"KL band: max_length_change must be in (0, 1), got {self.max_length_change}")
        if self.length_probe_size < 1:
            raise ValueError("KL band: length_probe_size must be >= 1")
        if self.stall_probes is not None and self.stall_probes < 1:
            raise ValueError(f"KL band: stall_probes must be >= 1 (or None), got {self.stall_probes}")
        if self.target_kl is not None and not self.low <= self.target_kl <= self.high:
            raise ValueError(f"KL band: target {self.target_kl} is outside [{self.low}, {self.high}]")

    @property
    def target(self) -> float:
        return self.target_kl if self.target_kl is not None else (self.low + self.high) / 2


def band_params(band: KLBand | None) -> dict[str, object]:
    """The KL band as run parameters (``band: off`` without one)."""
    if band is None:
        return {"band": "off"}
    return {"band_low": band.low, "band_high": band.high, "band_target": band.target,
            "band_probe_every": band.probe_every,
            "band_probe_size": band.probe_size, "band_max_epochs": band.max_epochs,
            "band_max_backoffs": band.max_backoffs,
            "band_max_length_change": band.max_length_change if band.max_length_change is not None else "off",
            "band_stall_probes": band.stall_probes if band.stall_probes is not None else "off"}


Action = Literal["continue", "stop", "back_off", "stall"]


def overshot(kl: float, length_change: float, band: KLBand) -> bool:
    """Whether a probe's figures are past the band: a KL above ``high`` (or not finite), or a
    mean-length change beyond the length guard."""
    too_long = band.max_length_change is not None and not abs(length_change) <= band.max_length_change
    return not math.isfinite(kl) or kl > band.high or too_long


def decide(kl: float, band: KLBand, backoffs: int, length_change: float = 0.0, stalls: int = 0) -> Action:
    """What to do after a probe measured ``kl`` (and ``length_change``, the relative change of
    the mean sampled completion length; ``stalls``, the probes in a row since a back-off that
    brought the KL no higher than the kept state's, this one included): ``back_off`` on an
    overshoot (``stop`` once ``max_backoffs`` are used up), ``stop`` at or above the target,
    ``stall`` (stop at the kept state) after ``stall_probes`` stalls, else ``continue``."""
    if overshot(kl, length_change, band):
        return "back_off" if backoffs < band.max_backoffs else "stop"
    if kl >= band.target:
        return "stop"
    return "stall" if band.stall_probes is not None and stalls >= band.stall_probes else "continue"


def stalled(kl: float, kept_kl: float, backoffs: int) -> bool:
    """Whether a probe inside the band made no progress after a back-off: its KL is no higher
    than the kept state's (the last probe that did)."""
    return backoffs > 0 and kl <= kept_kl


def stop_reason(kept_kl: float, overshoot: bool, action: Action, last: bool, band: KLBand) -> str:
    """Why training ended (or ``running``), for the increment's record; ``kept_kl`` is the KL
    of the policy kept after the probe (the restored one after an overshoot or a stall)."""
    if action == "stall":
        return "stalled"
    if action == "stop":
        return "backoffs_exhausted" if overshoot else "target"
    if last:
        return "window_exhausted_in_band" if kept_kl >= band.low else "window_exhausted_below_band"
    return "running"


def completion_kl(policy_logp: torch.Tensor, parent_logp: torch.Tensor, behavior_logp: torch.Tensor,
                  mask: torch.Tensor, truncate: float) -> float:
    """Mean over completions of the summed k3 terms ``w ((c/p - 1) - log(c/p))``, with
    ``w = min(p/mu, truncate)``: the offline gate's KL (trainer/gate.py), on tensors."""
    w = importance_weights(parent_logp, behavior_logp, truncate)
    per_seq = k3_tokens(policy_logp - parent_logp, w, mask).sum(dim=1)
    return float(per_seq.mean()) if per_seq.numel() else 0.0


def split_probe(n: int, size: int, seed: int) -> tuple[list[int], list[int]]:
    """``(train, probe)`` indices of a window of ``n`` samples: the probe set is up to ``size``
    samples (at most a fifth of the window), chosen by the seed and kept out of training, so its
    KL is not flattered by samples the policy has fitted. A window too small to spare any is
    probed on its own training samples."""
    k = min(size, n // 5)
    if k == 0:
        return list(range(n)), list(range(n))
    g = torch.Generator().manual_seed(seed + 7919)
    probe = sorted(torch.randperm(n, generator=g)[:k].tolist())
    held = set(probe)
    return [i for i in range(n) if i not in held], probe


class Probe:
    """The probe set, with the parent's log-probabilities computed once."""

    def __init__(self, parent: TrainablePolicy, picked: Sequence[Sample], truncate: float,
                 batch: int = 64) -> None:
        self.batches: list[tuple[list[list[int]], list[list[int]], list[float], torch.Tensor,
                                 torch.Tensor, torch.Tensor]] = []
        self.truncate = truncate
        with torch.no_grad():
            for i in range(0, len(picked), batch):
                chunk = picked[i : i + batch]
                prompts, completions = [s.prompt for s in chunk], [s.completion for s in chunk]
                temps = [s.temperature for s in chunk]  # as served, as the gate scores them
                parent_logp, mask = parent.batch_logprobs(prompts, completions, temps)
                behavior = padded([s.behavior_logprobs for s in chunk], parent_logp)
                self.batches.append((prompts, completions, temps, parent_logp, behavior,
                                     mask.to(parent_logp.dtype)))

    @torch.no_grad()
    def kl(self, policy: TrainablePolicy) -> float:
        was_training = policy.module.training
        policy.module.eval()
        total, n = 0.0, 0
        for prompts, completions, temps, parent_logp, behavior, mask in self.batches:
            logp, _ = policy.batch_logprobs(prompts, completions, temps)
            total += completion_kl(logp, parent_logp, behavior, mask, self.truncate) * len(prompts)
            n += len(prompts)
        policy.module.train(was_training)
        return total / n if n else 0.0


LENGTH_SEED = 104_729
"""Seeds of the length guard's samples (``LENGTH_SEED + i`` for prompt ``i``), the same for the
parent and every probe, so two samples differ only by the policy."""


def length_change(mean: float, parent_mean: float) -> float:
    """Relative change of a mean completion length against the parent's (0 when the parent's is 0)."""
    return mean / parent_mean - 1.0 if parent_mean > 0 else 0.0


class LengthProbe:
    """The mean length of completions sampled for fixed probe prompts, against the parent's.

    Completions are sampled at temperature 1 with at most the longest probe completion's
    length, and at least one token when every probe completion has one (as served)."""

    def __init__(self, parent: TrainablePolicy, picked: Sequence[Sample], size: int) -> None:
        chosen = list(picked)[:size]
        self.prompts = [list(s.prompt) for s in chosen]
        lengths = [len(s.completion) for s in chosen]
        self.max_new = max(lengths, default=1) or 1
        self.min_new = 1 if lengths and min(lengths) > 0 else 0
        self.parent_mean = self.mean_length(parent)

    @torch.no_grad()
    def mean_length(self, policy: TrainablePolicy) -> float:
        was_training = policy.module.training
        policy.module.eval()
        total = 0
        for i, prompt in enumerate(self.prompts):
            tokens, _ = policy.sample(prompt, self.max_new, temperature=1.0, seed=LENGTH_SEED + i,
                                      min_new_tokens=self.min_new)
            total += len(tokens)
        policy.module.train(was_training)
        return total / len(self.prompts) if self.prompts else 0.0

    def change(self, policy: TrainablePolicy) -> float:
        return length_change(self.mean_length(policy), self.parent_mean)


@dataclass
class Snapshot:
    """The policy and optimiser at the last probe inside the band."""

    step: int
    kl: float
    params: dict[str, torch.Tensor]
    """Trainable parameters only (for an adapter, the adapter)."""
    optimizer: dict[str, Any]
    moved: float = 0.0
    """The relative change of the mean sampled completion length there (0 without a length guard)."""

    @classmethod
    def take(cls, step: int, kl: float, policy: TrainablePolicy, opt: torch.optim.Optimizer,
             moved: float = 0.0) -> Snapshot:
        params = {n: p.detach().clone() for n, p in policy.module.named_parameters() if p.requires_grad}
        return cls(step, kl, params, copy.deepcopy(opt.state_dict()), moved)

    @torch.no_grad()
    def restore(self, policy: TrainablePolicy, opt: torch.optim.Optimizer) -> None:
        for n, p in policy.module.named_parameters():
            if n in self.params:
                p.copy_(self.params[n])
        opt.load_state_dict(self.optimizer)


BACKOFFS_KEY = "rtrl_backoffs"
"""Where the back-off count lives in the optimiser's first parameter group (so checkpoints keep it)."""


def lr_at(step: int, base: float, warmup_steps: int, backoffs: int) -> float:
    """The learning rate of optimiser step ``step`` (1-based): linear warm-up over the first
    ``warmup_steps`` (Adam's first steps are full-size in every parameter whatever the
    gradient's scale, which moved the policy far in directions the data did not ask for),
    halved once per back-off."""
    warm = min(1.0, step / warmup_steps) if warmup_steps > 0 else 1.0
    return base * warm * 0.5**backoffs


STOP_CODES = {"running": 0.0, "target": 1.0, "backoffs_exhausted": 2.0, "window_exhausted_in_band": 3.0,
              "window_exhausted_below_band": 4.0, "stalled": 5.0}
"""Why training ended, as the float the step history carries (``band_stop``)."""


def stop_name(code: float) -> str:
    """The stop reason from its code in the step history."""
    return next((k for k, v in STOP_CODES.items() if v == code), f"unknown ({code:g})")


class Steady:
    """The band's bookkeeping inside :func:`trainer.loop.rl_train`: probe, decide, snapshot."""

    def __init__(self, band: KLBand, parent: TrainablePolicy, probe: Sequence[Sample],
                 truncate: float) -> None:
        self.band = band
        self.probe = Probe(parent, probe, truncate)
        self.lengths = (LengthProbe(parent, probe, band.length_probe_size)
                        if band.max_length_change is not None and probe else None)
        self.backoffs = 0
        self.stalls = 0
        """Probes in a row since a back-off that brought the KL no higher than the kept state's
        (not checkpointed: a resumed run counts afresh)."""
        self.snapshot: Snapshot | None = None

    def measure(self, policy: TrainablePolicy) -> tuple[float, float]:
        """The probe's KL to the parent and, with a length guard, the relative change of the mean
        sampled completion length (0 without one)."""
        kl = self.probe.kl(policy)
        return kl, self.lengths.change(policy) if self.lengths is not None else 0.0

    def start(self, step: int, policy: TrainablePolicy, opt: torch.optim.Optimizer) -> bool:
        """Snapshot the starting point; False when a resumed policy is already at its target
        (or, from a checkpoint written mid-interval, past the band or the length guard: there
        is no kept state before it to go back to). A resumed run keeps the back-offs its
        checkpointed optimiser recorded."""
        self.backoffs = int(opt.param_groups[0].get(BACKOFFS_KEY, 0))
        kl, moved = self.measure(policy) if step else (0.0, 0.0)
        self.snapshot = Snapshot.take(step, kl, policy, opt, moved)
        return decide(kl, self.band, self.backoffs, moved) == "continue"

    def after_step(self, step: int, last: bool, policy: TrainablePolicy, opt: torch.optim.Optimizer,
                   stats: dict[str, float]) -> bool:
        """Probe when due; adds ``probe_kl``, ``backoffs``, ``band_stop`` (and with a length
        guard ``probe_length_change``) to ``stats``, each also ``..._kept`` for the policy kept.
        Returns True when training should stop."""
        if step % self.band.probe_every and not last:
            return False
        assert self.snapshot is not None, "start() first"
        kl, moved = self.measure(policy)
        overshoot = overshot(kl, moved, self.band)
        stuck = (self.band.stall_probes is not None and not overshoot
                 and stalled(kl, self.snapshot.kl, self.backoffs))
        self.stalls = self.stalls + 1 if stuck else 0
        action = decide(kl, self.band, self.backoffs, moved, self.stalls)
        stats["probe_kl"] = kl
        if self.lengths is not None:
            stats["probe_length_change"] = moved
        # back to the kept state after an overshoot, and when a stalled run ends (its kept state
        # is further along than where it crawled to)
        restore = overshoot or (stuck and (action == "stall" or last))
        if restore:
            self.snapshot.restore(policy, opt)
            if action == "back_off":
                self.backoffs += 1
            opt.param_groups[0][BACKOFFS_KEY] = self.backoffs  # checkpointed with the optimiser
        elif action == "continue" and not stuck:
            self.snapshot = Snapshot.take(step, kl, policy, opt, moved)
        kept = self.snapshot.kl if restore else kl
        stats["backoffs"] = float(self.backoffs)
        stats["probe_kl_kept"] = kept
        if self.lengths is not None:
            stats["probe_length_change_kept"] = self.snapshot.moved if restore else moved
        stats["band_stop"] = STOP_CODES[stop_reason(kept, overshoot, action, last, self.band)]
        return action in ("stop", "stall") or last
