"""One RL increment, end to end, over ports: window -> train -> gate -> register -> commit.

::

    champion = registry alias "champion"              (the parent; none: run `rtrl bootstrap`)
    window   = pending window (a retry) or cut..watermark on the rewards topic
    records  = parse; split train / held-out; too few -> skipped (recorded, cut not moved)
    pending  <- window                                (a crash from here on retries it)
    result   = TrainJob.run(parent, samples)          (Ray Train, checkpoints, resumable)
    gate     = offline checks on held-out records
    version  = registry.register(candidate, lineage + gate tags); alias "candidate" if passed
    cut      <- window ends; pending cleared          (each record trained once)

A crash between registering and committing is repaired on the next run: the pending window
is found on a registered version's ``rtrl.window`` tag, so its cut is committed instead of
training the window again.

The registry calls after training (step metrics, register, offer, close the run) are retried
with a bounded backoff, up to ``registry_retry_s`` per call, so a registry outage shorter than
that costs a wait, not the training. Before registering again after a failed attempt the
window's version is looked up first (the failed attempt may have registered it), so a window
never gets two versions. An outage outlasting the budget fails the increment with the window
pending, and the next run registers it.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol, TypeVar

import torch
from torch.optim import Optimizer

from deployer.registry import CHAMPION, LockUnavailableError, Registry, Tag, offer_candidate
from ingest.events import RewardRecord
from trainer.gate import GateConfig, GateResult, HeldoutScore, evaluate
from trainer.loop import LoopConfig, Sample
from trainer.objective import assign_groups, group_advantages, reward_stats
from trainer.policy import TrainablePolicy, load_policy
from trainer.window import (
    PendingWindow,
    RewardLog,
    Window,
    keep_served_by,
    parse_records,
    resume_or_plan,
    skip_reason,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


# ------------------------------------------------------------------ ports


@dataclass(frozen=True)
class TrainRequest:
    name: str
    """Run name; the same window always gets the same name, so a retry resumes."""
    parent_dir: Path
    samples: list[Sample]
    loop: LoopConfig
    workdir: Path


@dataclass
class TrainResult:
    policy_dir: Path
    history: list[dict[str, float]]
    resumed_from_step: int = 0
    """Steps already done by an earlier, killed attempt (0: trained from the parent)."""


class TrainJob(Protocol):
    def run(self, request: TrainRequest) -> TrainResult:
        """Train and return the candidate's saved directory; raise on failure."""
        ...


class RunTracker(Protocol):
    """Experiment tracking: one run per increment (MLflow in production)."""

    def start(self, name: str, params: dict[str, str], tags: dict[str, str]) -> str:
        """Open a run; return its id."""
        ...

    def log_steps(self, run_id: str, history: Sequence[dict[str, float]]) -> None:
        """Metrics over steps."""
        ...

    def finish(self, run_id: str, status: str, metrics: dict[str, float], tags: dict[str, str]) -> None:
        """Final metrics and tags; status FINISHED or FAILED."""
        ...


# ------------------------------------------------------------------ config and outcome


@dataclass(frozen=True)
class IncrementConfig:
    topic: str
    min_records: int = 64
    max_records: int = 200_000
    heldout_fraction: float = 0.1
    group_size: int = 8
    normalize_std: bool = False
    train_on: Literal["champions", "all"] = "champions"
    """``champions``: learn only from completions served by versions that were champion (the
    bootstrap, promoted versions, the current champion); records of canaries that were rolled
    back, aborted or are still undecided are consumed but not trained on. ``all``: every record."""
    loop: LoopConfig = field(default_factory=LoopConfig)
    gate: GateConfig = field(default_factory=GateConfig)
    registry_retry_s: float = 300.0
    """How long each registry call after training is retried (backoff 1 s doubling to 15 s)
    before the increment fails with its window pending."""


Status = Literal["success", "skipped", "failed"]


@dataclass
class Outcome:
    status: Status
    reason: str = ""
    window: Window | None = None
    version: str | None = None
    parent: str | None = None
    run_id: str | None = None
    gate: GateResult | None = None
    stats: dict[str, float] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    """total_s (trigger -> registered), train_s (the job), steps_s (gradient steps only)."""
    resumed_from_step: int = 0


# ------------------------------------------------------------------ pure helpers


def build_samples(records: Sequence[RewardRecord], group_size: int, normalize_std: bool) -> list[Sample]:
    """Samples with group-relative advantages (same-prompt groups first)."""
    groups = assign_groups([tuple(r.prompt_tokens) for r in records], group_size)
    adv = group_advantages([r.reward for r in records], groups, normalize_std)
    return [
        Sample(list(r.prompt_tokens), list(r.completion_tokens), list(r.behavior_logprobs), a)
        for r, a in zip(records, adv, strict=True)
    ]


@torch.no_grad()
def score_heldout(
    candidate: TrainablePolicy, parent: TrainablePolicy, records: Sequence[RewardRecord], batch: int = 64
) -> list[HeldoutScore]:
    candidate.module.eval()
    parent.module.eval()
    out: list[HeldoutScore] = []
    for i in range(0, len(records), batch):
        chunk = records[i : i + batch]
        prompts = [r.prompt_tokens for r in chunk]
        completions = [r.completion_tokens for r in chunk]
        cand, _ = candidate.batch_logprobs(prompts, completions)
        par, _ = parent.batch_logprobs(prompts, completions)
        for j, r in enumerate(chunk):
            n = len(r.completion_tokens)
            out.append(HeldoutScore(r.reward, r.behavior_logprobs, cand[j, :n].tolist(), par[j, :n].tolist()))
    return out


def summarize(history: Sequence[dict[str, float]]) -> dict[str, float]:
    """Per-increment statistics: means over steps, plus the last loss and token counts."""
    if not history:
        return {}
    keys = ["loss", "pg_loss", "kl", "kl_per_token", "clip_fraction", "ess", "truncated_fraction",
            "ratio_mean", "behavior_ratio_mean", "grad_norm"]
    out = {k: math.fsum(h[k] for h in history) / len(history) for k in keys if k in history[0]}
    out["ratio_max"] = max(h.get("ratio_max", 1.0) for h in history)
    out["behavior_ratio_max"] = max(h.get("behavior_ratio_max", 1.0) for h in history)
    out["final_loss"] = history[-1]["loss"]
    out["steps"] = float(len(history))
    out["tokens"] = math.fsum(h.get("seq_tokens", 0.0) for h in history)
    steps_s = math.fsum(h.get("step_seconds", 0.0) for h in history)
    out["steps_seconds"] = steps_s
    out["tokens_per_s"] = out["tokens"] / steps_s if steps_s > 0 else 0.0
    return out


class Retrying:
    """Calls a registry operation until it succeeds or ``budget_s`` has passed since its
    first failure (backoff 1 s, doubling, at most 15 s). ``failures`` counts failed attempts
    of every operation; ``on_retry`` is told about each one that will be retried."""

    def __init__(self, budget_s: float, on_retry: Callable[[BaseException], None] | None = None,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.budget_s, self.on_retry, self.sleep = budget_s, on_retry, sleep
        self.failures = 0

    def __call__(self, what: str, fn: Callable[[], T]) -> T:
        deadline: float | None = None
        pause = 1.0
        while True:
            try:
                return fn()
            except Exception as exc:
                self.failures += 1
                now = time.monotonic()
                deadline = now + self.budget_s if deadline is None else deadline
                if now >= deadline:
                    log.error("registry: could not %s within %.0fs: %s", what, self.budget_s, exc)
                    raise
                log.warning("registry: could not %s (%s: %s); retrying in %.0fs", what,
                            type(exc).__name__, str(exc)[:200], min(pause, deadline - now))
                if self.on_retry is not None:
                    self.on_retry(exc)
                self.sleep(min(pause, deadline - now))
                pause = min(15.0, pause * 2)


def registered_window_version(registry: Registry, window_id: str, look_back: int = 20) -> str | None:
    """The version (among the newest ``look_back``) trained on window ``window_id``."""
    for version in reversed(registry.versions()[-look_back:]):
        raw = registry.get_tags(version).get(Tag.WINDOW)
        if raw and json.loads(raw).get("id") == window_id:
            return version
    return None


# ------------------------------------------------------------------ the increment


def run_increment(
    cfg: IncrementConfig,
    rewards: RewardLog,
    registry: Registry,
    job: TrainJob,
    runs: RunTracker,
    pending: PendingWindow,
    workdir: Path,
    offer_lock: AbstractContextManager[object] | None = None,
    on_registry_retry: Callable[[BaseException], None] | None = None,
) -> Outcome:
    """One increment. Returns ``skipped`` or ``success``; raises when training or the
    registry fails (the pending window is then retried by the next run). ``offer_lock``
    serialises the writers of the ``candidate`` alias (see :func:`offer_candidate`);
    ``on_registry_retry`` is called for each failed registry call that is retried."""
    t0 = time.monotonic()
    parent = registry.alias_version(CHAMPION)
    if parent is None:
        return Outcome("failed", "no champion in the registry: run `rtrl bootstrap` first")

    stale = pending.load()
    if stale is not None and (done := registered_window_version(registry, stale.id)) is not None:
        log.warning("window %s was registered as version %s but not committed: committing", stale.id, done)
        rewards.commit(stale)
        pending.clear()
        stale = None

    window, retry = resume_or_plan(cfg.topic, rewards, stale, cfg.max_records)
    parsed = parse_records((v for _, _, v in rewards.read(window)), cfg.heldout_fraction)
    if cfg.train_on == "champions":
        parsed = keep_served_by(parsed, served_as_champion(registry, parent))
    window = window.with_counts(len(parsed.train) + len(parsed.heldout), parsed.invalid, len(parsed.heldout))
    log.info("window %s%s: %d records (%d held out, %d invalid, %d from versions never champion) "
             "over %d offsets", window.id, " (retry)" if retry else "", window.records, window.heldout,
             window.invalid, parsed.excluded, window.offsets)
    reason = skip_reason(window, len(parsed.train), cfg.min_records)
    if reason is not None:
        skip_tags = {"rtrl.outcome": "skipped", "rtrl.skip_reason": reason,
                     Tag.WINDOW: window.to_json(), Tag.PARENT_VERSION: parent}
        run_id = runs.start(f"skipped-{window.id}", {}, skip_tags)
        runs.finish(run_id, "FINISHED", {"records": float(window.records)}, {})
        pending.clear()
        return Outcome("skipped", reason, window=window, parent=parent, run_id=run_id)

    pending.save(window)
    workdir.mkdir(parents=True, exist_ok=True)
    parent_dir = registry.download(parent, workdir / f"parent-{parent}")
    samples = build_samples(parsed.train, cfg.group_size, cfg.normalize_std)
    spec_versions = ",".join(sorted({r.reward_spec_version for r in parsed.train}))
    rstats = reward_stats([r.reward for r in parsed.train], [r.arm for r in parsed.train])
    lineage = {
        Tag.PARENT_VERSION: parent,
        Tag.WINDOW: window.to_json(),
        Tag.REWARD_SPEC_VERSION: spec_versions,
        Tag.KIND: "increment",
    }
    run_tags = {**lineage, "rtrl.retry": str(retry)}
    run_id = runs.start(f"increment-{window.id}", _params(cfg, len(samples)), run_tags)
    retrying = Retrying(cfg.registry_retry_s, on_registry_retry)
    try:
        t_train = time.monotonic()
        result = job.run(TrainRequest(f"increment-{window.id}", parent_dir, samples, cfg.loop, workdir))
        train_s = time.monotonic() - t_train
        retrying("log the training steps", lambda: runs.log_steps(run_id, result.history))
        stats = {**summarize(result.history), **rstats}

        candidate = load_policy(result.policy_dir)
        gate = evaluate(
            score_heldout(candidate, load_policy(parent_dir), parsed.heldout),
            [h["loss"] for h in result.history],
            cfg.gate,
        )
        tags = {**lineage, Tag.GATE_RESULT: gate.result, Tag.GATE_REASONS: gate.reasons_json()}

        def register_once() -> str:
            if retrying.failures:  # a failed attempt may have registered the window already
                done = registered_window_version(registry, window.id)
                if done is not None:
                    return done
            return registry.register(run_id, result.policy_dir, tags)

        version = retrying("register the candidate", register_once)
        if gate.passed:
            retrying("offer the candidate", lambda: _offer(registry, version, offer_lock))
        rewards.commit(window)
        pending.clear()
    except BaseException:
        try:
            runs.finish(run_id, "FAILED", {}, {"rtrl.outcome": "failed"})
        except Exception as exc:  # the registry may be what failed; keep the original error
            log.warning("could not mark run %s failed: %s: %s", run_id, type(exc).__name__, exc)
        raise
    total_s = time.monotonic() - t0
    timings = {"total_s": total_s, "train_s": train_s, "steps_s": stats.get("steps_seconds", 0.0)}
    try:
        retrying("close the training run", lambda: runs.finish(
            run_id, "FINISHED", {**stats, **{f"gate_{k}": v for k, v in gate.figures.items()}, **timings},
            {"rtrl.outcome": "success", "rtrl.version": version, Tag.GATE_RESULT: gate.result}))
    except Exception:  # registered and committed: the increment did its work
        log.exception("version %s is registered and its window committed, but run %s was not closed",
                      version, run_id)
    log.info("increment %s -> version %s (gate %s%s) in %.1fs", window.id, version, gate.result,
             "" if gate.passed else f": {'; '.join(gate.reasons)}", total_s)
    return Outcome("success", "" if gate.passed else "; ".join(gate.reasons), window=window, version=version,
                   parent=parent, run_id=run_id, gate=gate, stats=stats, timings=timings,
                   resumed_from_step=result.resumed_from_step)


def served_as_champion(registry: Registry, champion: str) -> Callable[[str], bool]:
    """Whether a version has served as champion: the current one, a bootstrap or a promoted
    version (looked up once per version)."""
    seen: dict[str, bool] = {champion: True}

    def keep(version: str) -> bool:
        if version not in seen:
            try:
                tags = registry.get_tags(version)
            except KeyError:
                tags = {}
            seen[version] = tags.get(Tag.KIND) == "bootstrap" or tags.get(Tag.CANARY_OUTCOME) == "promoted"
        return seen[version]

    return keep


def _offer(registry: Registry, version: str, lock: AbstractContextManager[object] | None) -> None:
    """Offer a version that passed the gate as the candidate. A canary in flight keeps the
    alias (moving it would abort that canary), and so does a lock that cannot be taken: a
    later increment offers a fresher candidate either way."""
    try:
        held = offer_candidate(registry, version, lock)
    except LockUnavailableError as exc:
        log.warning("version %s passed the gate but was not offered as candidate: %s", version, exc)
        return
    if held is not None:
        log.info("version %s passed the gate but v%s is still under canary: the candidate "
                 "alias stays; a later increment offers a fresher candidate", version, held)


def _params(cfg: IncrementConfig, n: int) -> dict[str, str]:
    o = cfg.loop.objective
    return {k: str(v) for k, v in {
        "records": n, "group_size": cfg.group_size, "normalize_std": cfg.normalize_std,
        "batch_size": cfg.loop.batch_size, "epochs": cfg.loop.epochs, "lr": cfg.loop.lr,
        "max_grad_norm": cfg.loop.max_grad_norm, "clip_low": o.clip_low, "clip_high": o.clip_high,
        "truncate_is": o.truncate_is, "kl_coef": o.kl_coef, "seed": cfg.loop.seed,
        "heldout_fraction": cfg.heldout_fraction, "min_records": cfg.min_records,
    }.items()}


# ------------------------------------------------------------------ an in-process job


class LocalTrainJob:
    """Runs :func:`trainer.loop.rl_train` in this process, checkpointing under
    ``workdir/<name>/`` and resuming from there. Used by unit tests and the benchmark's
    baseline; production uses the Ray Train job."""

    def run(self, request: TrainRequest) -> TrainResult:
        from trainer.loop import load_training_state, rl_train, save_training_state

        ckpt = request.workdir / request.name / "checkpoint"
        if (ckpt / "train_state.pt").exists():
            policy, opt_state, start = load_training_state(ckpt)
        else:
            policy, opt_state, start = load_policy(request.parent_dir), None, 0
        parent = load_policy(request.parent_dir)

        def on_step(step: int, _s: dict[str, float], pol: TrainablePolicy, opt: Optimizer) -> None:
            if step % request.loop.checkpoint_every == 0:
                save_training_state(ckpt, pol, opt, step)

        history = rl_train(policy, parent, request.samples, request.loop, start, opt_state, on_step)
        out = request.workdir / request.name / "final"
        policy.save(out)
        return TrainResult(out, history, start)
