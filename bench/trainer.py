"""``rtrl bench trainer``: the RL step inside Ray Train vs the same loop without Ray, and the
fixed overhead of an increment.

1. **Throughput.** The same samples, config and checkpoint cadence train once in-process
   (``LocalTrainJob``: :func:`trainer.loop.rl_train` plus its checkpoints) and once as a Ray
   Train ``TorchTrainer`` job (one CPU worker). Steady-state tokens/s (prompt + completion
   tokens) is measured from the wall clock between the end of step ``warmup`` and the end of
   the last step — callbacks, reports and checkpoints included — so Ray's per-step costs
   count. The baseline runs before and after the Ray job; the ratio uses their mean.
2. **Fixed overhead.** A real increment on an embedded broker (free ports) and MLflow
   (sqlite): bootstrap a champion, produce reward records, then ``run_once`` (the code
   behind ``rtrl train --now``). Overhead = trigger -> candidate registered, minus the time
   spent in gradient steps. Run twice: cold (the increment starts local Ray) and warm (Ray
   already up, as in ``rtrl serve trainer``).
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
from services.local.sim_users import bootstrap_corpus
from services.local.stack import EmbeddedStack, free_port
from services.runtime.kafka_io import ensure_topics, make_producer
from services.runtime.service_settings import TrainerSettings
from services.runtime.settings import KafkaSettings, MlflowSettings, Settings, TopicSettings
from trainer.corpus import write_corpus
from trainer.loop import LoopConfig, Sample
from trainer.policy import TinyConfig, TinyTransformer, load_policy
from trainer.tokens import BOS
from trainer.train_job import LocalTrainJob, TrainRequest


def make_samples(policy: TinyTransformer, n: int, seed: int) -> list[Sample]:
    """Random logged completions with the policy's own log-probabilities as behavior
    (scored in batches: sampling them one by one would dominate the benchmark's run time)."""
    rng = random.Random(seed)
    prompts = [[BOS, 3 + rng.randrange(8), *(rng.randrange(12, 64) for _ in range(14))] for _ in range(n)]
    completions = [[rng.randrange(3, 64) for _ in range(rng.randrange(8, 17))] for _ in range(n)]
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


def median_step_tokens_per_s(history: Sequence[dict[str, float]], warmup: int) -> float:
    """Median over steps of tokens / in-step wall time: less sensitive to bursts of load from
    other processes, but blind to the per-step reporting cost outside the step."""
    rates = sorted(h["seq_tokens"] / h["step_seconds"] for h in history[warmup:])
    return rates[len(rates) // 2]


def throughput(samples: list[Sample], parent_dir: Path, loop: LoopConfig, warmup: int,
               workdir: Path) -> dict[str, float]:
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
    results["local_after"] = local("after")
    results["local"] = (results["local_before"] + results["local_after"]) / 2
    results["ratio"] = results["ray"] / results["local"]
    results["ratio_median_step"] = results["ray_median_step"] / (
        (results["local_before_median_step"] + results["local_after_median_step"]) / 2)
    return results


def overhead(records: int, workdir: Path) -> list[dict[str, object]]:
    from deployer.adapters.mlflow_registry import MlflowRegistry
    from services import trainer_job

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
        champion = trainer_job.bootstrap(s, corpus, epochs=1, lr=1e-3, batch_size=32)
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
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    env = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0", "MLFLOW_DISABLE_TELEMETRY": "true"}
    for key, value in env.items():
        os.environ.setdefault(key, value)

    torch.manual_seed(0)
    torch.set_num_threads(1)
    policy = TinyTransformer(TinyConfig())
    report: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="rtrl-bench-trainer-") as tmp:
        work = Path(tmp)
        parent_dir = policy.save(work / "parent")
        samples = make_samples(policy, args.samples, seed=1)
        loop = LoopConfig(batch_size=args.batch_size, epochs=args.epochs, lr=3e-4,
                          checkpoint_every=args.checkpoint_every)
        tp = throughput(samples, parent_dir, loop, args.warmup, work)
        report["throughput"] = tp
        print(f"RL step tokens/s (steady state, {len(samples)} samples, batch {args.batch_size}, "
              f"checkpoint every {args.checkpoint_every} steps, 1 CPU worker):")
        print(f"  plain loop (before/after)  {tp['local_before']:9.0f} / {tp['local_after']:.0f}")
        print(f"  inside Ray Train job       {tp['ray']:9.0f}   (fit wall {tp['ray_fit_wall_s']:.1f}s)")
        print(f"  ratio Ray / plain          {tp['ratio']:9.3f}   (target >= 0.9)")
        print(f"  median in-step tokens/s: plain {tp['local_before_median_step']:.0f} / "
              f"{tp['local_after_median_step']:.0f}, Ray {tp['ray_median_step']:.0f}, "
              f"ratio {tp['ratio_median_step']:.3f}")
        print(f"  (load average during the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
        if not args.skip_overhead:
            rows = overhead(args.records, work / "overhead")
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
