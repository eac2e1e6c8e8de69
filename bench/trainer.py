"""``rtrl bench trainer``: the RL step inside Ray Train vs the same loop without Ray, and the
fixed overhead of an increment.

1. **Throughput.** The same samples, config and checkpoint cadence train once in-process
   (``LocalTrainJob``: :func:`trainer.loop.rl_train` plus its checkpoints) and once as a Ray
   Train ``TorchTrainer`` job (one CPU worker; with ``--workers 2`` also two). Steady-state
   tokens/s (prompt + completion tokens) is measured from the wall clock between the end of
   step ``warmup`` and the end of the last step — callbacks, reports and checkpoints included —
   so Ray's per-step costs count. The baseline runs before and after the Ray job; the ratio uses their mean.
2. **Fixed overhead.** A real increment on an embedded broker (free ports) and MLflow
   (sqlite): bootstrap a champion, produce reward records, then ``run_once`` (the code
   behind ``rtrl train --now``). Overhead = trigger -> candidate registered, minus the time
   spent in gradient steps. Run twice: cold (the increment starts local Ray) and warm (Ray
   already up, as in ``rtrl serve trainer``).

``--policy lora`` runs both on a LoRA adapter (rank 8 on q_proj and v_proj) over the tiny Llama
model of services/stack/tiny_llm.py, built locally: the increment a real model gets.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import tempfile
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import torch

from ingest.events import ModelRef, RewardRecord
from services.runtime.kafka_io import ensure_topics, make_producer
from services.settings.model import KafkaSettings, MlflowSettings, Settings, TopicSettings
from services.settings.services import TrainerSettings
from services.sim.users import bootstrap_corpus
from services.stack.embedded import EmbeddedStack, free_port
from services.stack.tiny_llm import build_tiny_llm
from trainer.corpus import write_corpus
from trainer.loop import LoopConfig, Sample, plan_batches
from trainer.lora_policy import LoraSpec
from trainer.policy import (
    TinyConfig,
    TinyTransformer,
    TrainablePolicy,
    load_policy,
    n_parameters,
    n_trainable,
)
from trainer.tokens import BOS
from trainer.train_job import LocalTrainJob, TrainRequest

LORA = LoraSpec(rank=8, alpha=16)


def make_samples(policy: TrainablePolicy, n: int, seed: int, vocab: int = 64) -> list[Sample]:
    """Random logged completions (token ids below ``vocab``) with the policy's own
    log-probabilities as behavior (scored in batches: sampling them one by one would dominate
    the benchmark's run time)."""
    rng = random.Random(seed)
    prompts = [[BOS, 3 + rng.randrange(8), *(rng.randrange(12, vocab) for _ in range(14))] for _ in range(n)]
    completions = [[rng.randrange(3, vocab) for _ in range(rng.randrange(8, 17))] for _ in range(n)]
    out = []
    with torch.no_grad():
        for i in range(0, n, 128):
            lp, _ = policy.batch_logprobs(prompts[i : i + 128], completions[i : i + 128])
            for j, (p, c) in enumerate(zip(prompts[i : i + 128], completions[i : i + 128], strict=True)):
                out.append(Sample(p, c, lp[j, : len(c)].tolist(), rng.gauss(0, 1)))
    return out


def steady_tokens_per_s(history: Sequence[dict[str, float]], warmup: int) -> float:
    tail = history[warmup:]
    if len(tail) < 2:
        raise ValueError("not enough steps after warm-up")
    tokens = math.fsum(h["seq_tokens"] for h in tail[1:])
    return tokens / (tail[-1]["t_end"] - tail[0]["t_end"])


def whole_batch_tokens(history: Sequence[dict[str, float]], samples: Sequence[Sample],
                       loop: LoopConfig) -> list[dict[str, float]]:
    """The history of a data-parallel run (rank 0 reports its shard) with ``seq_tokens`` set to
    the whole batch's tokens, the work all workers did in the step."""
    batches = plan_batches(len(samples), loop.batch_size, loop.passes, loop.seed)
    return [{**h, "seq_tokens": float(sum(len(samples[i].prompt) + len(samples[i].completion)
                                          for i in batches[int(h["step"]) - 1]))} for h in history]


def median_step_tokens_per_s(history: Sequence[dict[str, float]], warmup: int) -> float:
    """Median over steps of tokens / in-step wall time: less sensitive to bursts of load from
    other processes, but blind to the per-step reporting cost outside the step."""
    rates = sorted(h["seq_tokens"] / h["step_seconds"] for h in history[warmup:])
    return rates[len(rates) // 2]


def throughput(samples: list[Sample], parent_dir: Path, loop: LoopConfig, warmup: int,
               workdir: Path, workers: int = 1) -> dict[str, float]:
    from trainer.adapters.ray_train import RayTrainJob, ensure_ray

    torch.set_num_threads(1)  # the Ray worker runs with one thread per CPU it holds
    results: dict[str, float] = {}

    def local(tag: str) -> float:
        req = TrainRequest(f"local-{tag}", parent_dir, samples, loop, workdir)
        history = LocalTrainJob().run(req).history
        results[f"local_{tag}_median_step"] = median_step_tokens_per_s(history, warmup)
        return steady_tokens_per_s(history, warmup)

    results["local_before"] = local("before")
    ensure_ray(os.environ.get("RTRL_RAY__ADDRESS"), num_cpus=2, object_store_mb=200)
    job = RayTrainJob(workdir / "ray", num_workers=1, cpus_per_worker=1)
    t0 = time.monotonic()
    res = job.run(TrainRequest("ray-bench", parent_dir, samples, loop, workdir))
    results["ray_fit_wall_s"] = time.monotonic() - t0
    results["ray"] = steady_tokens_per_s(res.history, warmup)
    results["ray_median_step"] = median_step_tokens_per_s(res.history, warmup)
    if workers > 1:
        t0 = time.monotonic()
        many = RayTrainJob(workdir / "ray", num_workers=workers, cpus_per_worker=1).run(
            TrainRequest(f"ray-bench-{workers}", parent_dir, samples, loop, workdir))
        results["ray_workers_fit_wall_s"] = time.monotonic() - t0
        results["ray_workers"] = steady_tokens_per_s(whole_batch_tokens(many.history, samples, loop), warmup)
        results["workers_ratio"] = results["ray_workers"] / results["ray"]
    results["local_after"] = local("after")
    results["local"] = (results["local_before"] + results["local_after"]) / 2
    results["ratio"] = results["ray"] / results["local"]
    results["ratio_median_step"] = results["ray_median_step"] / (
        (results["local_before_median_step"] + results["local_after_median_step"]) / 2)
    return results


def overhead(records: int, workdir: Path, lora_base: Path | None = None) -> list[dict[str, object]]:
    from deployer.adapters.mlflow_registry import MlflowRegistry
    from services.wiring import trainer as trainer_job

    stack = EmbeddedStack(workdir / "stack", kafka_port=free_port(), redis_port=free_port(),
                          reuse_redis_url=None, with_mlflow=False)
    stack.up(timeout_s=90)
    try:
        s = Settings(
            kafka=KafkaSettings(bootstrap_servers=stack.kafka_bootstrap),
            topics=TopicSettings(rewards="bench.rewards"),
            mlflow=MlflowSettings(tracking_uri=f"sqlite:///{workdir / 'mlflow.db'}"),
            trainer=TrainerSettings(data_dir=workdir / "trainer", min_records=32),
        )
        ensure_topics(s, [s.topics.rewards])
        corpus = workdir / "corpus.jsonl"
        write_corpus(corpus, bootstrap_corpus(300, seed=0))
        if lora_base is None:
            champion = trainer_job.bootstrap(s, corpus, epochs=1, lr=1e-3, batch_size=32)
        else:
            champion = trainer_job.bootstrap(s, corpus, epochs=1, lr=1e-3, batch_size=32,
                                             hf_model=str(lora_base), lora=LORA)
        registry = MlflowRegistry(s.mlflow.tracking_uri, s.mlflow.registered_model)
        policy = load_policy(registry.download(champion, workdir / "champ"))
        rows: list[dict[str, object]] = []
        for attempt in ("cold", "warm"):
            producer = make_producer(s.kafka)
            now = datetime.now(UTC)
            for i in range(records):
                rid = f"{attempt}-{i}"
                prompt = [BOS, 3 + i % 8, 20, 30]
                tokens, logps = policy.sample(prompt, 12, seed=i)
                rec = RewardRecord(request_id=rid, served_event_id=rid, session_id="s",
                                   user_key=f"u{i % 31}", served_ts=now, closed_ts=now,
                                   model=ModelRef(name="rtrl-policy", version="1"), arm="stable",
                                   prompt_tokens=prompt, completion_tokens=tokens,
                                   behavior_logprobs=logps, latency_ms=10.0, reward=random.random(),
                                   components={}, reward_spec_version="bench")
                producer.send(s.topics.rewards, key=rid.encode(), value=rec.model_dump_json().encode())
            producer.flush()
            producer.close()
            t0 = time.monotonic()
            out = trainer_job.run_once(s)
            total = time.monotonic() - t0
            if out.status != "success":
                raise RuntimeError(f"bench increment {attempt}: {out.status} {out.reason}")
            steps_s = out.stats.get("steps_seconds", 0.0)
            rows.append({"attempt": attempt, "total_s": total, "steps_s": steps_s,
                         "overhead_s": total - steps_s, "train_job_s": out.timings.get("train_s", 0.0),
                         "steps": out.stats.get("steps", 0.0)})
        return rows
    finally:
        stack.down()
        import ray

        if ray.is_initialized():
            ray.shutdown()


def bench_policy(kind: str, work: Path) -> tuple[TrainablePolicy, Path | None, int]:
    """The policy to train, its base model directory (LoRA) and the token ids to sample below."""
    if kind == "tiny":
        return TinyTransformer(TinyConfig()), None, 64
    from trainer.lora_policy import LoRAPolicy

    base = build_tiny_llm(work / "base")
    policy = LoRAPolicy.create(base, LORA)
    return policy, base, int(getattr(policy.model, "config").vocab_size)  # noqa: B009


def describe(policy: TrainablePolicy) -> str:
    total, trainable = n_parameters(policy.module), n_trainable(policy.module)
    return f"{getattr(policy, 'kind', '?')}, {trainable:,} of {total:,} parameters trained"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="rtrl bench trainer", description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=2048, help="samples for the throughput run")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=5, help="steps excluded from the steady state")
    ap.add_argument("--checkpoint-every", type=int, default=50,
                    help="steps between checkpoints (the trainer's default, RTRL_TRAINER__CHECKPOINT_EVERY)")
    ap.add_argument("--records", type=int, default=256, help="reward records per overhead increment")
    ap.add_argument("--skip-overhead", action="store_true")
    ap.add_argument("--policy", choices=("tiny", "lora"), default="tiny",
                    help="tiny: the built-in policy; lora: a LoRA adapter on a tiny Llama model built here")
    ap.add_argument("--workers", type=int, default=1, help="also time a Ray Train job with this many workers")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    env = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0", "MLFLOW_DISABLE_TELEMETRY": "true"}
    for key, value in env.items():
        os.environ.setdefault(key, value)

    torch.manual_seed(0)
    torch.set_num_threads(1)
    report: dict[str, object] = {"policy": args.policy}
    with tempfile.TemporaryDirectory(prefix="rtrl-bench-trainer-") as tmp:
        work = Path(tmp)
        policy, base, vocab = bench_policy(args.policy, work)
        parent_dir = policy.save(work / "parent")
        samples = make_samples(policy, args.samples, seed=1, vocab=vocab)
        loop = LoopConfig(batch_size=args.batch_size, epochs=args.epochs, lr=3e-4,
                          checkpoint_every=args.checkpoint_every)
        tp = throughput(samples, parent_dir, loop, args.warmup, work, args.workers)
        report["throughput"] = tp
        print(f"RL step tokens/s ({describe(policy)}; steady state, {len(samples)} samples, batch "
              f"{args.batch_size}, checkpoint every {args.checkpoint_every} steps, 1 CPU worker):")
        print(f"  plain loop (before/after)  {tp['local_before']:9.0f} / {tp['local_after']:.0f}")
        print(f"  inside Ray Train job       {tp['ray']:9.0f}   (fit wall {tp['ray_fit_wall_s']:.1f}s)")
        print(f"  ratio Ray / plain          {tp['ratio']:9.3f}   (target >= 0.9)")
        if args.workers > 1:
            print(f"  Ray Train, {args.workers} workers        {tp['ray_workers']:9.0f}   (fit wall "
                  f"{tp['ray_workers_fit_wall_s']:.1f}s; {tp['workers_ratio']:.2f}x one worker)")
        print(f"  median in-step tokens/s: plain {tp['local_before_median_step']:.0f} / "
              f"{tp['local_after_median_step']:.0f}, Ray {tp['ray_median_step']:.0f}, "
              f"ratio {tp['ratio_median_step']:.3f}")
        print(f"  (load average during the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
        if not args.skip_overhead:
            rows = overhead(args.records, work / "overhead", base)
            report["overhead"] = rows
            print("increment trigger -> candidate registered (real broker, MLflow sqlite, Ray Train):")
            for r in rows:
                print(f"  {r['attempt']!s:5s} total {r['total_s']:6.1f}s  "
                      f"gradient steps {r['steps_s']:5.1f}s  "
                      f"fixed overhead {r['overhead_s']:6.1f}s   (target <= 60 s)")
    import ray

    if ray.is_initialized():
        ray.shutdown()
    if args.json:
        print(json.dumps(report, indent=2))
    return 0
