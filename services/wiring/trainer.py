"""One RL increment and the first champion, wired to the real components named in settings:
the rewards topic on Kafka, Ray Train, and MLflow (tracking + registry).

``run_once`` is what the scheduled service (``rtrl serve trainer``) and ``rtrl train --now``
call; ``bootstrap`` is ``rtrl bootstrap``. A file lock in ``trainer.data_dir`` keeps
two increments from running at once, whichever process starts them.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from deployer.adapters.redis_state import candidate_lock, wake_deployer
from deployer.registry import manifest_tags
from ingest.contracts import prometheus as metrics
from ingest.contracts.registry import CHAMPION, PREVIOUS, RUN_VERSION, Tag
from ingest.reward.spec import parse_spec, spec_text
from services.runtime.kafka_io import ensure_topics, make_consumer
from services.runtime.mlflow_http import bound_mlflow_http
from services.runtime.redis_io import make_redis
from services.settings.model import Settings
from services.settings.services import BandSettings
from trainer.adapters.kafka_rewards import KafkaRewardLog
from trainer.corpus import read_corpus
from trainer.gate import GateConfig
from trainer.increment import IncrementConfig, Outcome, run_increment
from trainer.loop import LoopConfig, sft_train
from trainer.objective import ObjectiveConfig
from trainer.policy import TinyConfig, TinyTransformer, TrainablePolicy, n_parameters, n_trainable
from trainer.train_job import TrainJob
from trainer.trust_region import KLBand
from trainer.window import PendingWindow

if TYPE_CHECKING:
    from deployer.adapters.mlflow_registry import MlflowRegistry
    from trainer.lora_policy import LoraSpec

log = logging.getLogger("rtrl.trainer")

# MLflow, Ray and transformers are imported in the functions that use them
# (deployer.adapters.mlflow_registry, trainer.adapters.mlflow_runs, trainer.adapters.ray_train,
# trainer.hf_policy, ray): the commands that do not need them do not pay for their import.


# ------------------------------------------------------------------ wiring


def increment_config(settings: Settings) -> IncrementConfig:
    t = settings.trainer
    text = spec_text(settings.reward_spec)  # read once: its version and the file it logs
    return IncrementConfig(
        topic=settings.topics.rewards,
        min_records=t.min_records,
        max_records=t.max_records,
        heldout_fraction=t.heldout_fraction,
        group_size=t.group_size,
        normalize_std=t.normalize_std,
        train_on=t.train_on,
        loop=LoopConfig(
            batch_size=t.batch_size, epochs=t.epochs, lr=t.lr, warmup_steps=t.warmup_steps,
            max_grad_norm=t.max_grad_norm,
            seed=t.seed, checkpoint_every=t.checkpoint_every,
            objective=ObjectiveConfig(clip_low=t.clip_low, clip_high=t.clip_high,
                                      truncate_is=t.truncate_is, kl_coef=t.kl_coef),
            band=band_from(t.band),
        ),
        gate=GateConfig(**t.gate.model_dump()),
        registry_retry_s=t.registry_retry_s,
        reward_spec=(parse_spec(text).version, text),
    )


def band_from(b: BandSettings) -> KLBand | None:
    """The trainer's KL band from its settings (None when off)."""
    if not b.enabled:
        return None
    return KLBand(b.low, b.high, probe_every=b.probe_every, probe_size=b.probe_size,
                  max_epochs=b.max_epochs, max_backoffs=b.max_backoffs, max_length_change=b.max_length_change,
                  length_probe_size=b.length_probe_size, target_kl=b.target,
                  stall_probes=b.stall_probes)


def registry_from(settings: Settings) -> MlflowRegistry:
    from deployer.adapters.mlflow_registry import MlflowRegistry

    m = settings.mlflow
    return MlflowRegistry(m.tracking_uri, m.registered_model, m.training_experiment, m.deployments_experiment)


def ray_storage(settings: Settings) -> str:
    t = settings.trainer
    return t.ray_storage or str((t.data_dir / "ray").resolve())


def ray_job(settings: Settings) -> TrainJob:
    from trainer.adapters.ray_train import RayTrainJob

    r = settings.ray
    return RayTrainJob(ray_storage(settings), num_workers=r.num_workers, use_gpu=r.use_gpu,
                       cpus_per_worker=r.cpus_per_worker, address=r.address, num_cpus=r.num_cpus,
                       object_store_mb=r.object_store_mb)


class BusyError(RuntimeError):
    """Another increment holds the lock."""


@contextlib.contextmanager
def increment_lock(data_dir: Path) -> Iterator[None]:
    data_dir.mkdir(parents=True, exist_ok=True)
    with (data_dir / "increment.lock").open("w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise BusyError("another increment is running (lock held in the trainer data dir)") from exc
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def run_once(settings: Settings, job: TrainJob | None = None) -> Outcome:
    """One increment against the configured stack, with metrics. Raises on failure."""
    from trainer.adapters.mlflow_runs import MlflowRunTracker

    t = settings.trainer
    bound_mlflow_http(settings.mlflow)
    with increment_lock(t.data_dir):
        metrics.TRAIN_RUNNING.set(1)
        t0 = time.monotonic()
        ensure_topics(settings, [settings.topics.rewards])
        consumer = make_consumer(settings.kafka, t.consumer_group, isolation_level="read_committed",
                                 max_poll_records=2000)
        rewards = KafkaRewardLog(consumer, settings.topics.rewards)
        r = make_redis(settings.redis)
        try:
            outcome = run_increment(
                increment_config(settings), rewards, registry_from(settings), job or ray_job(settings),
                MlflowRunTracker(settings.mlflow.tracking_uri, settings.mlflow.training_experiment),
                PendingWindow(t.data_dir / "pending_window.json"), t.data_dir / "work",
                offer_lock=candidate_lock(r, settings.redis.key_prefix),
                on_registry_retry=lambda _exc: metrics.DEPENDENCY_RETRIES.labels("trainer", "mlflow").inc(),
            )
            if outcome.status == "success":
                wake_deployer(r, settings.redis.key_prefix, f"candidate v{outcome.version} registered")
        except BaseException:
            metrics.TRAIN_INCREMENTS.labels(outcome="failed").inc()
            raise
        finally:
            r.close()
            rewards.close()
            metrics.TRAIN_RUNNING.set(0)
        metrics.TRAIN_INCREMENTS.labels(outcome=outcome.status).inc()
        if outcome.status == "success":
            metrics.TRAIN_DURATION.observe(time.monotonic() - t0)
            metrics.TRAIN_LAST_SUCCESS.set(time.time())
            for key, value in outcome.stats.items():
                metrics.TRAIN_STAT.labels(stat=key).set(value)
            if outcome.gate is not None:
                metrics.GATE_RESULTS.labels(result=outcome.gate.result).inc()
            _cleanup(settings, outcome)
        return outcome


def _cleanup(settings: Settings, outcome: Outcome) -> None:
    """Checkpoints of a registered increment are no longer needed."""
    if outcome.window is None:
        return
    name = f"increment-{outcome.window.id}"
    shutil.rmtree(settings.trainer.data_dir / "work", ignore_errors=True)
    storage = ray_storage(settings)
    if "://" not in storage:
        shutil.rmtree(Path(storage) / name, ignore_errors=True)


def describe(outcome: Outcome) -> dict[str, object]:
    return {
        "status": outcome.status,
        "reason": outcome.reason,
        "version": outcome.version,
        "parent": outcome.parent,
        "gate": outcome.gate.result if outcome.gate else None,
        "window": json.loads(outcome.window.to_json()) if outcome.window else None,
        "resumed_from_step": outcome.resumed_from_step,
        "timings": {k: round(v, 2) for k, v in outcome.timings.items()},
        "stats": {k: round(v, 5) for k, v in outcome.stats.items()},
        "run_id": outcome.run_id,
    }


def bootstrap(
    settings: Settings, corpus: Path, epochs: int, lr: float, batch_size: int,
    hf_model: str | None = None, force: bool = False, lora: LoraSpec | None = None,
) -> str:
    """Train on the corpus, register, set ``champion``; return the version. With ``lora`` the
    policy is a LoRA adapter on the ``hf_model`` base (no epochs: the base as it is)."""
    from trainer.adapters.mlflow_runs import MlflowRunTracker

    registry = registry_from(settings)
    old = registry.alias_version(CHAMPION)
    if old is not None and not force:
        raise RuntimeError(f"version {old} is already champion; pass --force to replace it")
    policy: TrainablePolicy
    if hf_model and lora is not None:
        from trainer.lora_policy import LoRAPolicy

        policy = LoRAPolicy.create(hf_model, lora, seed=settings.trainer.seed)
    elif hf_model:
        from trainer.hf_policy import HFPolicy

        policy = HFPolicy.from_pretrained(hf_model)
    else:
        policy = TinyTransformer(TinyConfig())
    pairs = read_corpus(corpus)
    digest = hashlib.sha256(corpus.read_bytes()).hexdigest()[:16]
    runs = MlflowRunTracker(settings.mlflow.tracking_uri, settings.mlflow.training_experiment)
    cfg = LoopConfig(batch_size=batch_size, epochs=epochs, lr=lr, seed=settings.trainer.seed)
    params = {"corpus": str(corpus), "corpus_sha256": digest, "records": str(len(pairs)),
              "epochs": str(epochs), "lr": str(lr), "batch_size": str(batch_size),
              "parameters": str(n_parameters(policy.module)),
              "trainable_parameters": str(n_trainable(policy.module)),
              **({"lora": json.dumps(asdict(lora)), "base_model": str(hf_model)} if lora else {})}
    run_id = runs.start("bootstrap", params, {Tag.KIND: "bootstrap"})
    t0 = time.monotonic()
    last = [t0]

    def progress(step: int, stats: dict[str, float], *_: object) -> None:
        if time.monotonic() - last[0] > 5 or step == stats["total_steps"]:
            last[0] = time.monotonic()
            log.info("bootstrap step %d/%d loss %.4f", step, int(stats["total_steps"]), stats["loss"])

    try:
        history = sft_train(policy, pairs, cfg, on_step=progress) if epochs > 0 else []
        runs.log_steps(run_id, history)
        out = settings.trainer.data_dir / "bootstrap" / run_id
        policy.save(out)
        notes = json.dumps({"reasons": [], "notes": ["bootstrap: supervised, not gated"]})
        tags = {Tag.KIND: "bootstrap", Tag.PARENT_VERSION: "", "rtrl.corpus_sha256": digest,
                Tag.GATE_RESULT: "pass", Tag.GATE_REASONS: notes, **manifest_tags(out)}
        version = registry.register(run_id, out, tags)
        if old is not None:
            registry.set_alias(PREVIOUS, old)
        registry.set_alias(CHAMPION, version)
    except BaseException:
        runs.finish(run_id, "FAILED", {}, {})
        raise
    final = {"final_loss": history[-1]["loss"]} if history else {}
    runs.finish(run_id, "FINISHED", {**final, "seconds": time.monotonic() - t0},
                {RUN_VERSION: version})
    shutil.rmtree(out, ignore_errors=True)
    return version


def ray_running() -> bool:
    if "ray" not in sys.modules:
        return False
    import ray

    return bool(ray.is_initialized())


def shutdown_ray() -> None:
    """Shut Ray down if this process connected to it (nothing otherwise)."""
    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            ray.shutdown()
