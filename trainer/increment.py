"""One RL increment, end to end, over ports: plan -> train -> gate -> register -> commit.

::

    champion = registry alias "champion"              (the parent; none: run `rtrl bootstrap`)
    window   = pending window (a retry) or cut..watermark on the rewards topic
    records  = parse; split train / held-out; too few -> skipped (recorded, cut not moved)
    pending  <- window                                (a crash from here on retries it)
    result   = TrainJob.run(parent, samples)          (Ray Train, checkpoints, resumable)
    gate     = offline checks on held-out records
    version  = registry.register(candidate, lineage + gate tags); alias "candidate" if passed
    cut      <- window ends; pending cleared          (each record trained once)

A crash between registering and committing is repaired on the next run: the pending window is
found on a registered version's ``rtrl.window`` tag, so its cut is committed, not trained again.

The registry calls after training are retried within ``registry_retry_s`` per call, and a
window never gets two versions (trainer/registration.py). The training job's port and the
in-process job are in trainer/train_job.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from deployer.registry import Registry
from ingest.contracts.registry import CHAMPION, NOTE, RUN_OUTCOME, RUN_RETRY, RUN_SKIP_REASON, Tag
from ingest.events import RewardRecord
from trainer.gate import GateConfig, GateResult, HeldoutScore, evaluate
from trainer.loop import LoopConfig, Sample, summarize
from trainer.mismatch import Mismatch, measure_parent
from trainer.objective import reward_stats
from trainer.policy import TrainablePolicy, load_policy, score_records
from trainer.registration import (
    SKIPPED_NOTE,
    SPEC_ARTIFACT,
    Retrying,
    RunTracker,
    close_interrupted,
    close_run,
    mark_failed,
    offer,
    register_candidate,
    registered_window_version,
    success_note,
)
from trainer.samples import build_samples, to_samples
from trainer.train_job import TrainJob, TrainRequest, TrainResult
from trainer.trust_region import band_params, stop_name
from trainer.window import (
    ParsedWindow,
    PendingWindow,
    RewardLog,
    Window,
    keep_served_by,
    parse_records,
    resume_or_plan,
    skip_reason,
)

log = logging.getLogger(__name__)


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
    reward_spec: tuple[str, str] = ("", "")
    """The reward spec this trainer runs with: (version, the file's text). An increment whose
    records were all rewarded under that version logs the file on its run (``reward_spec.toml``)."""


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


# ------------------------------------------------------------------ what each step hands on


@dataclass(frozen=True)
class Plan:
    """The plan step's decision: which window, its records, and whether to train on them."""

    parent: str
    """The champion's version: the candidate's starting point."""
    window: Window
    retry: bool
    """The window was pending: an earlier attempt at it failed."""
    records: ParsedWindow
    skip: str | None
    """Why the window is not trained on (too few records); None: train."""


@dataclass(frozen=True)
class TrainingRun:
    """The opened tracking run and what the training job needs."""

    run_id: str
    name: str
    """``increment-<window id>``: the same window always gets the same name, so a retry resumes."""
    parent_dir: Path
    samples: list[Sample]
    probe: list[Sample]
    """The held-out records as samples: where the KL band measures the step (the gate's set)."""
    lineage: dict[str, str]
    """The registry tags that tie the version to its parent, window and reward spec."""
    reward_stats: dict[str, float]
    mismatch: Mismatch
    """The parent's train-inference mismatch on the records it served (trainer/mismatch.py)."""


@dataclass(frozen=True)
class Trained:
    """The train step's result: the candidate, how long the job took, per-increment statistics."""

    result: TrainResult
    train_s: float
    stats: dict[str, float]


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
    """One increment, in steps:

    1. **plan**: the parent is the champion (none: ``failed``); a pending window already
       registered is committed; the window to train is the pending one or cut..watermark;
       its records are read and split; too few -> ``skipped`` (recorded, cut not moved).
    2. **train**: the window is saved as pending, the parent downloaded, the run opened and
       the job run on the samples.
    3. **gate**: candidate and parent are scored on the held-out records.
    4. **register**: the version is registered with lineage and gate tags, and offered as the
       ``candidate`` if it passed (under ``offer_lock``, see :func:`offer_candidate`).
    5. **commit**: the window's cut is committed and the pending window cleared; the run is
       closed.

    Returns ``failed`` (no champion), ``skipped`` or ``success``; raises when training or the
    registry fails (the run is marked failed and the pending window is retried by the next
    run). ``on_registry_retry`` is called for each failed registry call that is retried.
    """
    t0 = time.monotonic()
    parent = registry.alias_version(CHAMPION)
    if parent is None:
        return Outcome("failed", "no champion in the registry: run `rtrl bootstrap` first")
    plan = plan_increment(cfg, rewards, registry, pending, parent)
    if plan.skip is not None:
        return record_skip(plan, plan.skip, runs, pending)

    pending.save(plan.window)  # from here on a crash retries this window
    run = start_run(cfg, plan, registry, runs, workdir)
    retrying = Retrying(cfg.registry_retry_s, on_registry_retry)
    try:
        trained = train(job, run, cfg.loop, workdir, runs, retrying)
        gate = gate_candidate(trained.result, run.parent_dir, plan.records.heldout, cfg.gate, run.mismatch)
        version = register_candidate(registry, retrying, run.run_id, plan.window.id,
                                     trained.result.policy_dir, {**run.lineage, **gate_tags(gate)})
        if gate.passed:
            retrying("offer the candidate", lambda: offer(registry, version, offer_lock))
        commit_window(rewards, pending, plan.window)
    except BaseException:
        mark_failed(runs, run.run_id)
        raise

    timings = {"total_s": time.monotonic() - t0, "train_s": trained.train_s,
               "steps_s": trained.stats.get("steps_seconds", 0.0)}
    close_run(runs, retrying, run.run_id, version, gate, trained.stats, timings,
              success_note(parent, plan.window.to_json(), version, gate))
    st = trained.stats
    band = (f"; KL band: {stop_name(st['band_stop'])} at {st['band_probe_kl']:.2f} nats "
            f"after {st['steps']:.0f} steps" if "band_stop" in st else "")
    if "band_length_change" in st:
        band += f", mean length {st['band_length_change']:+.1%}"
    log.info("increment %s -> version %s (gate %s%s%s) in %.1fs", plan.window.id, version, gate.result,
             "" if gate.passed else f": {'; '.join(gate.reasons)}", band, timings["total_s"])
    return Outcome("success", "" if gate.passed else "; ".join(gate.reasons), window=plan.window,
                   version=version, parent=parent, run_id=run.run_id, gate=gate, stats=trained.stats,
                   timings=timings, resumed_from_step=trained.result.resumed_from_step)


# ------------------------------------------------------------------ plan


def plan_increment(
    cfg: IncrementConfig, rewards: RewardLog, registry: Registry, pending: PendingWindow, parent: str
) -> Plan:
    """Pick the window (the pending one, or cut..watermark), read its records and decide
    whether there are enough to train on."""
    window, retry = resume_or_plan(cfg.topic, rewards, window_to_retry(registry, rewards, pending),
                                   cfg.max_records)
    records = read_records(cfg, rewards, registry, window, parent)
    window = window.with_counts(len(records.train) + len(records.heldout), records.invalid,
                                len(records.heldout))
    log.info("window %s%s: %d records (%d held out, %d invalid, %d from versions never champion) "
             "over %d offsets", window.id, " (retry)" if retry else "", window.records, window.heldout,
             window.invalid, records.excluded, window.offsets)
    return Plan(parent, window, retry, records, skip_reason(window, len(records.train), cfg.min_records))


def window_to_retry(registry: Registry, rewards: RewardLog, pending: PendingWindow) -> Window | None:
    """The pending window, to train again; None when there is none, or when it was already
    registered (a crash between registering and committing): its cut is committed now."""
    stale = pending.load()
    if stale is None:
        return None
    done = registered_window_version(registry, stale.id)
    if done is None:
        return stale
    log.warning("window %s was registered as version %s but not committed: committing", stale.id, done)
    commit_window(rewards, pending, stale)
    return None


def read_records(
    cfg: IncrementConfig, rewards: RewardLog, registry: Registry, window: Window, parent: str
) -> ParsedWindow:
    """The window's records, parsed and split; with ``train_on="champions"`` only those served
    by versions that were champion."""
    records = parse_records((v for _, _, v in rewards.read(window)), cfg.heldout_fraction)
    if cfg.train_on == "champions":
        records = keep_served_by(records, served_as_champion(registry, parent))
    return records


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


def record_skip(plan: Plan, reason: str, runs: RunTracker, pending: PendingWindow) -> Outcome:
    """A skipped window leaves a finished run saying why; its cut does not move."""
    tags = {RUN_OUTCOME: "skipped", RUN_SKIP_REASON: reason, NOTE: SKIPPED_NOTE.format(reason=reason),
            Tag.WINDOW: plan.window.to_json(), Tag.PARENT_VERSION: plan.parent}
    run_id = runs.start(f"skipped-{plan.window.id}", {}, tags)
    runs.finish(run_id, "FINISHED", {"records": float(plan.window.records)}, {})
    pending.clear()
    return Outcome("skipped", reason, window=plan.window, parent=plan.parent, run_id=run_id)


# ------------------------------------------------------------------ train


def start_run(cfg: IncrementConfig, plan: Plan, registry: Registry, runs: RunTracker,
              workdir: Path) -> TrainingRun:
    """Download the parent, build the samples and open the tracking run."""
    workdir.mkdir(parents=True, exist_ok=True)
    parent_dir = registry.download(plan.parent, workdir / f"parent-{plan.parent}")
    train_records = plan.records.train
    samples = build_samples(train_records, cfg.group_size, cfg.normalize_std)
    rstats = reward_stats([r.reward for r in train_records], [r.arm for r in train_records])
    lineage = {
        Tag.PARENT_VERSION: plan.parent,
        Tag.WINDOW: plan.window.to_json(),
        Tag.REWARD_SPEC_VERSION: ",".join(sorted({r.reward_spec_version for r in train_records})),
        Tag.KIND: "increment",
    }
    found = measure_parent(load_policy(parent_dir), train_records, plan.parent,
                           cfg.loop.objective.truncate_is)
    name = f"increment-{plan.window.id}"
    run_id = runs.start(name, _params(cfg, len(samples)), {**lineage, RUN_RETRY: str(plan.retry)})
    if plan.retry:  # a run of this window that its trainer left open is closed as interrupted
        close_interrupted(runs, name, run_id)
    version, text = cfg.reward_spec
    if text and lineage[Tag.REWARD_SPEC_VERSION] == version:
        runs.log_text(run_id, text, SPEC_ARTIFACT)
    probe = to_samples(plan.records.heldout, [0.0] * len(plan.records.heldout))
    return TrainingRun(run_id, name, parent_dir, samples, probe, lineage, {**rstats, **found.figures()},
                       found)


def train(job: TrainJob, run: TrainingRun, loop: LoopConfig, workdir: Path, runs: RunTracker,
          retrying: Retrying) -> Trained:
    """Run the training job and log its steps on the run."""
    t_train = time.monotonic()
    result = job.run(TrainRequest(run.name, run.parent_dir, run.samples, loop, workdir, run.probe))
    train_s = time.monotonic() - t_train
    retrying("log the training steps", lambda: runs.log_steps(run.run_id, result.history))
    return Trained(result, train_s, {**summarize(result.history), **run.reward_stats})


# ------------------------------------------------------------------ gate


def gate_candidate(result: TrainResult, parent_dir: Path, heldout: Sequence[RewardRecord],
                   cfg: GateConfig, found: Mismatch | None = None) -> GateResult:
    """The offline gate on the held-out records and the parent's mismatch (trainer/gate.py)."""
    candidate = load_policy(result.policy_dir)
    scores = score_heldout(candidate, load_policy(parent_dir), heldout)
    return evaluate(scores, [h["loss"] for h in result.history], cfg, found)


def gate_tags(gate: GateResult) -> dict[str, str]:
    """The gate's verdict as registry tags, beside the lineage."""
    return {Tag.GATE_RESULT: gate.result, Tag.GATE_REASONS: gate.reasons_json()}


# ------------------------------------------------------------------ commit


def commit_window(rewards: RewardLog, pending: PendingWindow, window: Window) -> None:
    """Move the cut past the window: its records are never trained on again."""
    rewards.commit(window)
    pending.clear()


# ------------------------------------------------------------------ pure helpers


def score_heldout(candidate: TrainablePolicy, parent: TrainablePolicy, records: Sequence[RewardRecord],
                  batch: int = 64) -> list[HeldoutScore]:
    """Held-out records scored under both policies at the temperature each was served with."""
    prompts, completions = [r.prompt_tokens for r in records], [r.completion_tokens for r in records]
    temperatures = [r.temperature for r in records]
    cand = score_records(candidate, prompts, completions, batch, temperatures)
    par = score_records(parent, prompts, completions, batch, temperatures)
    return [HeldoutScore(r.reward, r.behavior_logprobs, c, p)
            for r, c, p in zip(records, cand, par, strict=True)]


def _params(cfg: IncrementConfig, n: int) -> dict[str, str]:
    o = cfg.loop.objective
    return {k: str(v) for k, v in {
        "records": n, "group_size": cfg.group_size, "normalize_std": cfg.normalize_std,
        "batch_size": cfg.loop.batch_size, "epochs": cfg.loop.epochs, "lr": cfg.loop.lr,
        "max_grad_norm": cfg.loop.max_grad_norm, "clip_low": o.clip_low, "clip_high": o.clip_high,
        "truncate_is": o.truncate_is, "kl_coef": o.kl_coef, "seed": cfg.loop.seed,
        "heldout_fraction": cfg.heldout_fraction, "min_records": cfg.min_records,
        **band_params(cfg.loop.band),
    }.items()}

