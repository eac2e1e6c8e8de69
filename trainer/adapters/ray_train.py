"""The increment as a Ray Train ``TorchTrainer`` job.

Every worker runs :func:`trainer.loop.rl_train` on its shard of each batch (gradients are
averaged with ``torch.distributed`` when there are several workers); rank 0 reports a
checkpoint (policy + optimizer + step) every ``LoopConfig.checkpoint_interval`` steps. The run
is named after the data window and stored under ``storage`` — so a retry of the same window (the
process or a worker was killed) finds the run's checkpoints, and ``ray.train.get_checkpoint()``
hands the worker the last one to resume from. A new window gets a new run.

:func:`ensure_ray` connects to ``RaySettings.address`` when set, otherwise starts a local
Ray bound to loopback with the CPUs and object store from settings.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
import ray.train
import ray.train.torch
import torch
from ray.train import Checkpoint, CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from trainer.loop import load_training_state, make_optimizer, rl_train, save_training_state
from trainer.lora_policy import BASE_DIR_ENV
from trainer.policy import TrainablePolicy, load_policy
from trainer.train_job import TrainRequest, TrainResult

log = logging.getLogger(__name__)

RAY_ENV = {
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
}
HISTORY_FILE = "history.json"
FORWARDED_ENV = (BASE_DIR_ENV,)
"""Settings the workers need that a remote cluster's processes do not inherit."""


def ensure_ray(address: str | None, num_cpus: int = 2, object_store_mb: int = 200) -> None:
    """Connect to the cluster at ``address`` or start local Ray (no-op when connected)."""
    for key, value in RAY_ENV.items():
        os.environ.setdefault(key, value)
    if ray.is_initialized():
        return
    if address:  # workers on other machines see this process's base model location too
        forwarded = {k: os.environ[k] for k in FORWARDED_ENV if os.environ.get(k)}
        ray.init(address=address, log_to_driver=True,
                 runtime_env={"env_vars": forwarded} if forwarded else None)
    else:
        ray.init(
            num_cpus=num_cpus,
            _node_ip_address="127.0.0.1",
            object_store_memory=object_store_mb * 1024**2,
            log_to_driver=True,
        )


def _average_gradients(policy: TrainablePolicy) -> None:
    world = torch.distributed.get_world_size()
    for p in policy.module.parameters():
        if p.grad is not None:
            torch.distributed.all_reduce(p.grad, op=torch.distributed.ReduceOp.SUM)
            p.grad /= world


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Runs inside each Ray Train worker."""
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    request: TrainRequest = config["request"]
    torch.set_num_threads(int(config.get("threads", 1)))
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            policy, opt_state, start = load_training_state(Path(d))
        logging.getLogger("rtrl.trainer").info("resuming %s from step %d", request.name, start)
    else:
        policy, opt_state, start = load_policy(request.parent_dir), None, 0
    parent = load_policy(request.parent_dir)
    if config.get("use_gpu"):  # this worker's GPU (Ray sets CUDA_VISIBLE_DEVICES per worker)
        device = ray.train.torch.get_device()
        policy.module.to(device)
        parent.module.to(device)
    every = request.loop.checkpoint_interval
    t_last = time.monotonic()
    optimizer_holder: dict[str, torch.optim.Optimizer] = {}

    def on_step(step: int, stats: dict[str, float], pol: TrainablePolicy, opt: torch.optim.Optimizer) -> None:
        nonlocal t_last
        optimizer_holder["opt"] = opt
        metrics = {k: v for k, v in stats.items() if isinstance(v, float)} | {"resumed_from_step": start}
        if step % every == 0 and step < stats["total_steps"]:
            with tempfile.TemporaryDirectory() as tmp:
                if rank == 0:
                    save_training_state(Path(tmp), pol, opt, step)
                ray.train.report(metrics, checkpoint=Checkpoint.from_directory(tmp) if rank == 0 else None)
        if rank == 0 and time.monotonic() - t_last > 5:
            t_last = time.monotonic()
            logging.getLogger("rtrl.trainer").info(
                "%s step %d/%d loss %.4f kl %.4f clip %.3f ess %.3f", request.name, step,
                int(stats["total_steps"]), stats["loss"], stats["kl"], stats["clip_fraction"], stats["ess"])

    after = _average_gradients if world > 1 else None
    history = rl_train(policy, parent, request.samples, request.loop, start, opt_state, on_step,
                       shard=(rank, world), after_backward=after, probe=request.probe)
    with tempfile.TemporaryDirectory() as tmp:
        final_step = start + len(history)
        if rank == 0:
            opt = optimizer_holder.get("opt") or make_optimizer(policy, request.loop.lr)
            save_training_state(Path(tmp), policy, opt, final_step)
            body = {"history": history, "resumed_from_step": start}
            (Path(tmp) / HISTORY_FILE).write_text(json.dumps(body))
        final = {"final": 1.0, "step": float(final_step), "resumed_from_step": float(start)}
        ray.train.report(final, checkpoint=Checkpoint.from_directory(tmp) if rank == 0 else None)


class RayTrainJob:
    """:class:`trainer.train_job.TrainJob` on Ray Train."""

    def __init__(
        self,
        storage: str | Path,
        num_workers: int = 1,
        use_gpu: bool = False,
        cpus_per_worker: int = 1,
        address: str | None = None,
        num_cpus: int = 2,
        object_store_mb: int = 200,
    ) -> None:
        self.storage = str(storage)
        self.num_workers = num_workers
        self.use_gpu = use_gpu
        self.cpus_per_worker = cpus_per_worker
        self.address = address
        self.num_cpus = num_cpus
        self.object_store_mb = object_store_mb

    def run(self, request: TrainRequest) -> TrainResult:
        ensure_ray(self.address, self.num_cpus, self.object_store_mb)
        if "://" not in self.storage:
            Path(self.storage).mkdir(parents=True, exist_ok=True)
        trainer = TorchTrainer(
            train_loop_per_worker,
            train_loop_config={"request": request, "threads": self.cpus_per_worker,
                               "use_gpu": self.use_gpu},
            scaling_config=ScalingConfig(
                num_workers=self.num_workers, use_gpu=self.use_gpu,
                resources_per_worker={"CPU": self.cpus_per_worker},
            ),
            run_config=RunConfig(
                name=request.name,
                storage_path=self.storage,
                checkpoint_config=CheckpointConfig(num_to_keep=2),
                failure_config=FailureConfig(max_failures=0),
            ),
        )
        log.info("Ray Train run %s: %d samples on %d worker(s), storage %s",
                 request.name, len(request.samples), self.num_workers, self.storage)
        result = trainer.fit()
        if result.checkpoint is None:
            raise RuntimeError(f"Ray Train run {request.name} finished without a checkpoint")
        out = request.workdir / request.name / "final"
        if out.exists():
            shutil.rmtree(out)
        result.checkpoint.to_directory(str(out))
        body = json.loads((out / HISTORY_FILE).read_text())
        return TrainResult(out / "policy", body["history"], int(body["resumed_from_step"]))
