"""The trainer on real components: rewards on the real broker -> ``rtrl train --now`` on real
Ray -> a registered version with lineage in real MLflow (sqlite) and the candidate alias ->
gate result recorded; a second increment trains only the new records; and an increment whose
Ray worker is killed mid-training resumes from its checkpoint and consumes its window once.

One local Ray (2 CPUs, loopback) serves the whole module and is shut down at its end.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from pathlib import Path

import pytest
from reward_helpers import reward_record

from deployer.adapters.mlflow_registry import MlflowRegistry
from ingest.contracts.registry import CANDIDATE, CHAMPION, Tag
from services.cli import train as train_cli
from services.runtime.kafka_io import ensure_topics, make_producer
from services.settings.model import Settings, get_settings
from services.settings.services import TrainerSettings
from services.sim.users import bootstrap_corpus
from services.wiring import trainer as trainer_job
from tests.ray_procs import descendants_named
from trainer.corpus import write_corpus
from trainer.policy import load_policy
from trainer.tokens import BOS
from trainer.window import PendingWindow

pytestmark = pytest.mark.timeout(600)
SNAPSHOT = "checkpoint_manager_snapshot.json"


@pytest.fixture
def trainer_settings(settings: Settings, tmp_path: Path) -> Settings:
    ensure_topics(settings, [settings.topics.rewards])
    return settings.model_copy(update={
        "mlflow": settings.mlflow.model_copy(update={"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}),
        "trainer": TrainerSettings(data_dir=tmp_path / "trainer", min_records=40, batch_size=16,
                                   checkpoint_every=4, heldout_fraction=0.15),
    })


def use_env(monkeypatch: pytest.MonkeyPatch, s: Settings, tmp_path: Path) -> None:
    """Point `rtrl train --now` (which reads settings from the environment) at this test."""
    monkeypatch.setenv("RTRL_STACK__DATA_DIR", str(tmp_path / "no-stack"))
    monkeypatch.setenv("RTRL_KAFKA__BOOTSTRAP_SERVERS", s.kafka.bootstrap_servers)
    monkeypatch.setenv("RTRL_TOPICS__REWARDS", s.topics.rewards)
    monkeypatch.setenv("RTRL_MLFLOW__TRACKING_URI", s.mlflow.tracking_uri)
    monkeypatch.setenv("RTRL_TRAINER", s.trainer.model_dump_json())
    get_settings.cache_clear()


def bootstrap_champion(s: Settings, tmp_path: Path) -> str:
    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus, bootstrap_corpus(200, seed=0))
    return trainer_job.bootstrap(s, corpus, epochs=1, lr=1e-3, batch_size=32)


def produce_rewards(s: Settings, policy_dir: Path, n: int, start: int) -> None:
    """Completions sampled from the champion, rewarded when they start with a low token id."""
    policy = load_policy(policy_dir)
    rng = random.Random(start)
    producer = make_producer(s.kafka)
    for i in range(start, start + n):
        prompt = [BOS, 3 + rng.randrange(4), *(rng.randrange(10, 64) for _ in range(4))]
        tokens, logps = policy.sample(prompt, 8, seed=i)
        rec = reward_record(i, f"u{i % 23}", prompt, tokens, logps, 1.0 if tokens[0] < 30 else -0.25)
        producer.send(s.topics.rewards, key=rec.request_id.encode(), value=rec.model_dump_json().encode())
    producer.flush()
    producer.close()


def train_now(capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    code = train_cli.main(["train", "--now", "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    body: dict[str, object] = json.loads(out[out.index("{"):])
    return body


def test_rewards_to_registered_candidate_then_only_new_records(
    ray_local: None, trainer_settings: Settings, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    s = trainer_settings
    champion = bootstrap_champion(s, tmp_path)
    registry = MlflowRegistry(s.mlflow.tracking_uri, s.mlflow.registered_model)
    assert registry.alias_version(CHAMPION) == champion
    champ_dir = registry.download(champion, tmp_path / "champ")
    produce_rewards(s, champ_dir, 120, start=0)
    use_env(monkeypatch, s, tmp_path)

    first = train_now(capsys)
    assert first["status"] == "success", first
    version = str(first["version"])
    tags = registry.get_tags(version)
    assert tags[Tag.PARENT_VERSION] == champion and tags[Tag.KIND] == "increment"
    assert tags[Tag.REWARD_SPEC_VERSION] == "default-v1"
    window = json.loads(tags[Tag.WINDOW])
    assert window["topic"] == s.topics.rewards and window["records"] == 120
    assert len(window["ranges"]) == 4 and sum(r["end"] - r["start"] for r in window["ranges"]) >= 120
    assert tags[Tag.GATE_RESULT] == "pass", tags[Tag.GATE_REASONS]
    assert "figures" in json.loads(tags[Tag.GATE_REASONS])
    assert registry.alias_version(CANDIDATE) == version
    run = registry.client.get_run(registry.run_id(version) or "")
    assert run.data.tags[Tag.PARENT_VERSION] == champion and run.info.status == "FINISHED"
    assert {"clip_fraction", "ess", "kl", "reward_mean_canary", "reward_mean_stable"} <= set(run.data.metrics)
    assert len(registry.client.get_metric_history(run.info.run_id, "loss")) >= 2
    # the KL band (on by default): its settings, the probe per step, the kept KL and why it stopped
    band = s.trainer.band
    assert run.data.params["band_low"] == str(band.low) and run.data.params["band_high"] == str(band.high)
    assert run.data.tags["rtrl.band.stop"] in {"target", "backoffs_exhausted", "window_exhausted_in_band",
                                               "window_exhausted_below_band"}
    assert {"band_probe_kl", "band_backoffs", "gate_kl_parent", "steps"} <= set(run.data.metrics)
    assert registry.client.get_metric_history(run.info.run_id, "probe_kl")
    assert load_policy(registry.download(version, tmp_path / "cand")).sample([BOS, 4], 4, seed=0)

    produce_rewards(s, champ_dir, 60, start=1000)
    second = train_now(capsys)
    assert second["status"] == "success", second
    w2 = second["window"]
    assert isinstance(w2, dict) and w2["records"] == 60
    ends = {r["partition"]: r["end"] for r in window["ranges"]}
    assert {r["partition"]: r["start"] for r in w2["ranges"]} == ends
    assert registry.get_tags(str(second["version"]))[Tag.PARENT_VERSION] == champion

    third = train_now(capsys)
    assert third["status"] == "skipped" and "no new reward records" in str(third["reason"])


def ray_train_workers() -> list[int]:
    """PIDs of this process's Ray Train worker processes (Ray names them in their command line)."""
    return descendants_named(os.getpid(), "RayTrainWorker")


@pytest.mark.reliability  # also part of scripts/reliability (trainer, deployer and worker kills)
def test_killed_increment_resumes_from_checkpoint_and_consumes_window_once(
    ray_local: None, trainer_settings: Settings, tmp_path: Path,
) -> None:
    s = trainer_settings.model_copy(update={"trainer": trainer_settings.trainer.model_copy(
        update={"batch_size": 4, "checkpoint_every": 5})})
    champion = bootstrap_champion(s, tmp_path)
    registry = MlflowRegistry(s.mlflow.tracking_uri, s.mlflow.registered_model)
    produce_rewards(s, registry.download(champion, tmp_path / "champ"), 240, start=0)

    errors: list[BaseException] = []

    def attempt() -> None:
        try:
            trainer_job.run_once(s)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=attempt)
    thread.start()
    pending = PendingWindow(s.trainer.data_dir / "pending_window.json")
    storage = Path(trainer_job.ray_storage(s))
    killed = False
    deadline = time.monotonic() + 240
    while thread.is_alive() and time.monotonic() < deadline:
        window = pending.load()
        # kill once Ray Train has recorded a checkpoint in its run snapshot (the resume point)
        if window is not None and (storage / f"increment-{window.id}" / SNAPSHOT).exists():
            for pid in ray_train_workers():
                os.kill(pid, 9)
                killed = True
            if killed:
                break
        time.sleep(0.1)
    thread.join(timeout=240)
    assert killed, "never saw a checkpoint to kill the worker after"
    assert errors, "the killed increment should have failed"
    first = pending.load()
    assert first is not None, "the pending window must survive the failure"
    assert registry.versions() == [champion]

    outcome = trainer_job.run_once(s)
    assert outcome.status == "success" and outcome.window is not None
    assert outcome.window.id == first.id
    assert outcome.resumed_from_step >= 5, "the retry must start from the checkpoint"
    assert outcome.window.records == 240
    assert pending.load() is None
    again = trainer_job.run_once(s)
    assert again.status == "skipped" and "no new reward records" in again.reason


def test_two_workers_train_what_one_process_trains(ray_local: None, tmp_path: Path) -> None:
    """Data parallel on Ray Train (gloo on CPU): each worker takes its half of every batch and the
    gradients are averaged, so a LoRA adapter trained by two workers is the one a single process
    trains on the same samples (up to float summation order)."""
    import torch

    from services.stack.tiny_llm import build_tiny_llm
    from trainer.adapters.ray_train import RayTrainJob
    from trainer.loop import LoopConfig, Sample
    from trainer.lora_policy import LoRAPolicy, LoraSpec
    from trainer.train_job import LocalTrainJob, TrainRequest

    base = build_tiny_llm(tmp_path / "base")
    start = LoRAPolicy.create(base, LoraSpec(rank=4, alpha=8))
    parent_dir = start.save(tmp_path / "parent")
    rng = random.Random(3)
    samples = []
    for _ in range(64):
        prompt = [rng.randrange(4, 200) for _ in range(6)]
        completion = [rng.randrange(4, 200) for _ in range(rng.randrange(3, 9))]
        samples.append(Sample(prompt, completion, start.score(prompt, completion), rng.gauss(0, 1)))
    loop = LoopConfig(batch_size=16, epochs=2, lr=1e-2, checkpoint_every=4)
    one = LocalTrainJob().run(TrainRequest("one", parent_dir, samples, loop, tmp_path / "local"))
    two = RayTrainJob(tmp_path / "ray", num_workers=2, cpus_per_worker=1).run(
        TrainRequest("two", parent_dir, samples, loop, tmp_path / "ray-work"))
    assert len(two.history) == len(one.history) == 8
    a, b = load_policy(one.policy_dir), load_policy(two.policy_dir)
    lora_a = {n: p for n, p in a.module.named_parameters() if "lora_" in n}
    lora_b = dict(b.module.named_parameters())
    assert lora_a and all(torch.allclose(p, lora_b[n], atol=1e-5) for n, p in lora_a.items())
    moved = max(float((p - q).detach().abs().max()) for (n, p), q in zip(
        lora_a.items(), (dict(start.module.named_parameters())[n] for n in lora_a), strict=True))
    assert moved > 1e-3, "training changed nothing: the comparison proves nothing"
