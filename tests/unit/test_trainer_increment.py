"""The training loop and one increment over in-memory ports: RL moves the policy toward
rewarded completions, a resumed run equals an uninterrupted one, windows are consumed once,
small windows are skipped, and the registry gets lineage, gate tags and the candidate alias."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path

import pytest
import torch
from training_helpers import killed_and_resumed

from deployer.adapters.memory import InMemoryRegistry
from ingest.contracts.registry import CANDIDATE, CHAMPION, Tag
from ingest.events import ModelRef, RewardRecord
from trainer.adapters.memory import InMemoryRewardLog
from trainer.gate import GateConfig
from trainer.increment import IncrementConfig, run_increment
from trainer.loop import (
    LoopConfig,
    Sample,
    plan_batches,
    rl_train,
    summarize,
)
from trainer.policy import TinyConfig, TinyTransformer, load_policy
from trainer.samples import build_samples
from trainer.tokens import BOS, EOS
from trainer.train_job import LocalTrainJob, TrainRequest
from trainer.window import PendingWindow

SMALL = TinyConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, max_len=32)
GOOD = 20
GOOD_SET = frozenset(range(20, 36))  # completions starting with one of these are rewarded


class ListRuns:
    """A run tracker that remembers everything (unit tests only)."""

    def __init__(self) -> None:
        self.runs: dict[str, dict[str, object]] = {}

    def start(self, name: str, params: dict[str, str], tags: dict[str, str]) -> str:
        run_id = f"run{len(self.runs)}"
        self.runs[run_id] = {"name": name, "params": params, "tags": dict(tags), "steps": []}
        return run_id

    def log_steps(self, run_id: str, history: Sequence[dict[str, float]]) -> None:
        self.runs[run_id]["steps"] = list(history)

    def finish(self, run_id: str, status: str, metrics: dict[str, float], tags: dict[str, str]) -> None:
        self.runs[run_id].update(status=status, metrics=metrics)
        self.runs[run_id]["tags"].update(tags)  # type: ignore[attr-defined]

    def open_runs(self, name: str) -> list[str]:
        return [k for k, r in self.runs.items() if r["name"] == name and "status" not in r]

    def log_text(self, run_id: str, text: str, name: str) -> None:
        self.runs[run_id].setdefault("artifacts", {})[name] = text  # type: ignore[index]


def served(policy: TinyTransformer, n: int, seed: int, start: int = 0, version: str = "1") -> list[bytes]:
    """Completions sampled from ``policy`` with their behavior log-probs, rewarded by GOOD."""
    rng = random.Random(seed)
    now = datetime(2026, 1, 1, tzinfo=UTC)
    out = []
    for i in range(start, start + n):
        prompt = [BOS, 3 + rng.randrange(3)]
        tokens, logps = policy.sample(prompt, 4, seed=seed * 100_000 + i)
        reward = 1.0 if tokens[0] in GOOD_SET else 0.0
        out.append(RewardRecord(
            request_id=f"req-{i}", served_event_id=f"ev-{i}", session_id="s", user_key=f"u{i % 17}",
            served_ts=now, closed_ts=now, model=ModelRef(name="rtrl-policy", version=version),
            arm="stable" if i % 4 else "canary", prompt_tokens=prompt, completion_tokens=tokens,
            behavior_logprobs=logps, latency_ms=5.0, reward=reward, components={"accept": reward},
            reward_spec_version="v1",
        ).model_dump_json().encode())
    return out


def good_prob(policy: TinyTransformer) -> float:
    probs = [policy.score([BOS, 3 + k], [g])[0] for k in range(3) for g in GOOD_SET]
    return float(torch.tensor(probs).exp().sum()) / 3


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models run fastest single-threaded, and the test machine is shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def champion() -> TinyTransformer:
    torch.manual_seed(0)
    return TinyTransformer(SMALL)


def test_plan_batches_is_deterministic_and_covers_every_sample_each_epoch() -> None:
    b = plan_batches(10, 4, 2, seed=1)
    assert b == plan_batches(10, 4, 2, seed=1)
    assert [len(x) for x in b] == [4, 4, 2, 4, 4, 2]
    assert sorted(i for batch in b[:3] for i in batch) == list(range(10))


def test_rl_moves_probability_toward_rewarded_completions(champion: TinyTransformer) -> None:
    from trainer.window import parse_records

    parsed = parse_records(served(champion, 160, seed=1), 0.0)
    samples = build_samples(parsed.train, group_size=8, normalize_std=False)
    assert any(s.advantage > 0 for s in samples)
    policy = champion.clone()
    before = good_prob(policy)
    history = rl_train(policy, champion.clone(), samples, LoopConfig(batch_size=32, epochs=3, lr=3e-3))
    assert good_prob(policy) > before + 0.1, (before, good_prob(policy))
    stats = summarize(history)
    assert stats["steps"] == 15 and stats["tokens_per_s"] > 0
    assert 0 < stats["ess"] <= 1 and 0 <= stats["clip_fraction"] <= 1


def test_resumed_training_equals_uninterrupted(champion: TinyTransformer, tmp_path: Path) -> None:
    samples = [Sample([BOS, 4], [GOOD, EOS], [-4.0, -4.0], 1.0),
               Sample([BOS, 5], [9, EOS], [-4.0, -4.0], -1.0)] * 8
    cfg = LoopConfig(batch_size=4, epochs=2, lr=1e-2)
    full, resumed, history = killed_and_resumed(champion, samples, cfg, 3, tmp_path / "ck")
    assert history[0]["step"] == 4 and len(history) == 5
    for a, b in zip(full.module.state_dict().values(), resumed.module.state_dict().values(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def setup(champion: TinyTransformer, tmp_path: Path) -> tuple[InMemoryRegistry, InMemoryRewardLog, ListRuns]:
    registry = InMemoryRegistry(tmp_path / "registry")
    v = registry.register(None, champion.save(tmp_path / "champ"), {Tag.KIND: "bootstrap"})
    registry.set_alias(CHAMPION, v)
    return registry, InMemoryRewardLog("rewards", partitions=2), ListRuns()


def config(**kw: object) -> IncrementConfig:
    base: dict[str, object] = dict(topic="rewards", min_records=32, heldout_fraction=0.2,
                                   loop=LoopConfig(batch_size=16, lr=1e-3), gate=GateConfig(min_heldout=5))
    base.update(kw)
    return IncrementConfig(**base)  # type: ignore[arg-type]


def test_increment_registers_candidate_with_lineage_and_consumes_window_once(
    champion: TinyTransformer, tmp_path: Path
) -> None:
    registry, log, runs = setup(champion, tmp_path)
    for i, v in enumerate(served(champion, 120, seed=2)):
        log.append(i % 2, v)
    pending = PendingWindow(tmp_path / "pending.json")
    spec = ("v1", "version = 'v1'\n")
    out = run_increment(config(reward_spec=spec), log, registry, LocalTrainJob(), runs, pending,
                        tmp_path / "work")
    assert out.status == "success", out.reason
    assert out.version is not None and registry.alias_version(CANDIDATE) == out.version
    tags = registry.get_tags(out.version)
    assert tags[Tag.PARENT_VERSION] == "1" and tags[Tag.KIND] == "increment"
    assert tags[Tag.REWARD_SPEC_VERSION] == "v1" and tags[Tag.GATE_RESULT] == "pass"
    window = json.loads(tags[Tag.WINDOW])
    assert window["topic"] == "rewards" and window["records"] == 120 and window["heldout"] > 0
    assert [(r["start"], r["end"]) for r in window["ranges"]] == [(0, 60), (0, 60)]
    assert log.cut == {0: 60, 1: 60} and pending.load() is None
    run = runs.runs[out.run_id or ""]
    assert run["status"] == "FINISHED" and run["steps"]
    assert run["artifacts"] == {"reward_spec.toml": spec[1]}, "the rewards' own spec, as written"
    note = run["tags"]["mlflow.note.content"]  # type: ignore[index]
    assert note.startswith("Increment of v1: trained on `rewards` offsets p0 0–60, p1 0–60; 120 records; "
                           f"registered as v{out.version}.")
    assert "Offline gate against v1: **passed**." in note and "- KL from v1: " in note
    assert "- Reward on the held-out records, estimated for this candidate: " in note
    assert "reward_mean_canary" in out.stats and "clip_fraction" in out.stats

    # nothing new: skipped, recorded, cut unchanged
    again = run_increment(config(reward_spec=("v2", "other")), log, registry, LocalTrainJob(), runs,
                          pending, tmp_path / "work")
    assert again.status == "skipped" and "no new reward records" in again.reason
    skipped = runs.runs[again.run_id or ""]
    assert skipped["tags"]["mlflow.note.content"].startswith("**Skipped:** no new reward records")  # type: ignore[index]
    assert registry.versions() == ["1", "2"]

    # a few new records: too few -> skipped, and they stay for later
    for i, v in enumerate(served(champion, 10, seed=3, start=1000)):
        log.append(i % 2, v)
    small = run_increment(config(), log, registry, LocalTrainJob(), runs, pending, tmp_path / "work")
    assert small.status == "skipped" and "too few records" in small.reason
    assert log.cut == {0: 60, 1: 60}
    for i, v in enumerate(served(champion, 60, seed=4, start=2000)):
        log.append(i % 2, v)
    second = run_increment(config(reward_spec=("v2", "other")), log, registry, LocalTrainJob(), runs, pending,
                           tmp_path / "work")
    assert second.status == "success"
    assert "artifacts" not in runs.runs[second.run_id or ""], "records of spec v1: not the v2 file"
    assert second.window is not None and second.window.records == 70  # the 10 waited, then came along
    assert second.window.starts() == {0: 60, 1: 60}


def test_failed_increment_retries_the_same_window_and_resumes(
    champion: TinyTransformer, tmp_path: Path
) -> None:
    registry, log, runs = setup(champion, tmp_path)
    for i, v in enumerate(served(champion, 100, seed=5)):
        log.append(i % 2, v)
    pending = PendingWindow(tmp_path / "pending.json")

    class Crashing(LocalTrainJob):
        def run(self, request: TrainRequest) -> object:  # type: ignore[override]
            from dataclasses import replace

            short = replace(request, samples=request.samples[:32])  # 2 steps, checkpoint at 2
            super().run(replace(short, loop=replace(request.loop, checkpoint_every=2)))
            raise RuntimeError("worker died")

    cfg = config(loop=LoopConfig(batch_size=16, lr=1e-3, checkpoint_every=2))
    with pytest.raises(RuntimeError):
        run_increment(cfg, log, registry, Crashing(), runs, pending, tmp_path / "work")
    first = pending.load()
    assert first is not None and log.cut == {0: None, 1: None}
    assert [r["status"] for r in runs.runs.values()] == ["FAILED"]
    for i, v in enumerate(served(champion, 40, seed=6, start=500)):  # arrive meanwhile
        log.append(i % 2, v)
    out = run_increment(cfg, log, registry, LocalTrainJob(), runs, pending, tmp_path / "work")
    assert out.status == "success" and out.window is not None
    assert out.window.id == first.id and out.resumed_from_step == 2
    assert log.cut == first.ends()
    nxt = run_increment(cfg, log, registry, LocalTrainJob(), runs, pending, tmp_path / "work")
    assert nxt.window is not None and nxt.window.records == 40  # only the new ones


def test_a_run_its_trainer_left_open_is_closed_as_interrupted_by_the_retry(
    champion: TinyTransformer, tmp_path: Path
) -> None:
    """A trainer stopped past its grace (or SIGKILLed) mid-increment cannot close its run: the
    run that trains the window again closes it as KILLED, outcome interrupted, pointing at
    itself. A FAILED run (an exception the trainer saw) is left as it is."""
    registry, log, runs = setup(champion, tmp_path)
    for i, v in enumerate(served(champion, 100, seed=5)):
        log.append(i % 2, v)
    pending = PendingWindow(tmp_path / "pending.json")

    class Vanishing(LocalTrainJob):  # the process is gone: nothing after this line runs
        def run(self, request: TrainRequest) -> object:  # type: ignore[override]
            raise SystemExit(0)

    with pytest.raises(SystemExit):
        run_increment(config(), log, registry, Vanishing(), runs, pending, tmp_path / "work")
    (left_open,) = runs.runs
    runs.runs[left_open].pop("status")  # the process died: mark_failed never ran
    out = run_increment(config(), log, registry, LocalTrainJob(), runs, pending, tmp_path / "work")
    assert out.status == "success" and out.run_id != left_open
    old = runs.runs[left_open]
    assert old["status"] == "KILLED", old
    tags = old["tags"]
    assert isinstance(tags, dict)
    assert tags["rtrl.outcome"] == "interrupted" and tags["rtrl.resumed_by"] == out.run_id
    assert f"trained again by run {out.run_id}" in tags["mlflow.note.content"]
    assert runs.runs[out.run_id]["status"] == "FINISHED"


def test_crash_after_registration_is_repaired_without_retraining(
    champion: TinyTransformer, tmp_path: Path
) -> None:
    registry, log, runs = setup(champion, tmp_path)
    for i, v in enumerate(served(champion, 80, seed=7)):
        log.append(i % 2, v)
    pending = PendingWindow(tmp_path / "pending.json")
    real_commit = log.commit
    log.commit = lambda w: (_ for _ in ()).throw(ConnectionError("broker gone"))  # type: ignore[method-assign]
    with pytest.raises(ConnectionError):
        run_increment(config(), log, registry, LocalTrainJob(), runs, pending, tmp_path / "work")
    assert registry.versions() == ["1", "2"] and pending.load() is not None
    log.commit = real_commit  # type: ignore[method-assign]
    out = run_increment(config(), log, registry, LocalTrainJob(), runs, pending, tmp_path / "work")
    assert out.status == "skipped" and "no new reward records" in out.reason
    assert registry.versions() == ["1", "2"] and log.cut == {0: 40, 1: 40}


def test_no_champion_is_a_clear_failure(tmp_path: Path) -> None:
    out = run_increment(config(), InMemoryRewardLog("rewards"), InMemoryRegistry(tmp_path / "r"),
                        LocalTrainJob(), ListRuns(), PendingWindow(tmp_path / "p.json"), tmp_path)
    assert out.status == "failed" and "rtrl bootstrap" in out.reason


def test_failed_gate_gets_no_candidate_alias(champion: TinyTransformer, tmp_path: Path) -> None:
    registry, log, runs = setup(champion, tmp_path)
    for i, v in enumerate(served(champion, 100, seed=8)):
        log.append(i % 2, v)
    cfg = config(gate=GateConfig(max_kl=1e-12, min_heldout=5), loop=LoopConfig(batch_size=16, lr=1e-2))
    out = run_increment(cfg, log, registry, LocalTrainJob(), runs, PendingWindow(tmp_path / "p.json"),
                        tmp_path / "w")
    assert out.status == "success" and out.version is not None
    assert registry.get_tags(out.version)[Tag.GATE_RESULT] == "fail"
    assert "KL to parent" in json.loads(registry.get_tags(out.version)[Tag.GATE_REASONS])["reasons"][0]
    assert registry.alias_version(CANDIDATE) is None
    assert load_policy(registry.download(out.version, tmp_path / "dl")) is not None


def test_candidate_under_canary_keeps_the_alias(champion: TinyTransformer, tmp_path: Path) -> None:
    """A newer passing version must not move the alias off a canary in flight (the deployer
    would abort it); once that canary is decided, the next increment becomes the candidate."""
    registry, log, runs = setup(champion, tmp_path)
    pending = PendingWindow(tmp_path / "pending.json")
    for i, v in enumerate(served(champion, 120, seed=2)):
        log.append(i % 2, v)
    first = run_increment(config(), log, registry, LocalTrainJob(), runs, pending, tmp_path / "work")
    assert first.status == "success" and registry.alias_version(CANDIDATE) == first.version
    for i, v in enumerate(served(champion, 120, seed=5, start=3000)):
        log.append(i % 2, v)
    assert first.version is not None
    registry.set_tags(first.version, {Tag.CANARY_OUTCOME: "running"})  # the deployer started its canary
    second = run_increment(config(), log, registry, LocalTrainJob(), runs, pending, tmp_path / "work")
    assert second.status == "success" and second.version is not None
    assert registry.get_tags(second.version)[Tag.GATE_RESULT] == "pass"
    assert registry.alias_version(CANDIDATE) == first.version, "the canary in flight keeps its alias"
    assert first.version is not None
    registry.set_tags(first.version, {Tag.CANARY_OUTCOME: "rolled_back"})  # what the deployer does
    registry.delete_alias(CANDIDATE)
    for i, v in enumerate(served(champion, 120, seed=6, start=6000)):
        log.append(i % 2, v)
    third = run_increment(config(), log, registry, LocalTrainJob(), runs, pending, tmp_path / "work")
    assert third.status == "success" and registry.alias_version(CANDIDATE) == third.version


@pytest.mark.parametrize("train_on", ["champions", "all"])
def test_records_of_versions_never_champion_are_not_trained_on(
    champion: TinyTransformer, tmp_path: Path, train_on: str
) -> None:
    """Completions served by a rolled-back canary (or one still undecided) are consumed but
    not learnt from by default: a reward-hacked canary must not teach the next increment."""
    registry, log, runs = setup(champion, tmp_path)
    rolled = registry.register(None, champion.save(tmp_path / "bad"), {Tag.KIND: "increment"})
    registry.set_tags(rolled, {Tag.CANARY_OUTCOME: "rolled_back"})
    promoted = registry.register(None, champion.save(tmp_path / "good"), {Tag.KIND: "increment"})
    registry.set_tags(promoted, {Tag.CANARY_OUTCOME: "promoted"})
    batches = [served(champion, 80, seed=2), served(champion, 50, seed=3, start=1000, version=rolled),
               served(champion, 40, seed=4, start=2000, version=promoted),
               served(champion, 30, seed=5, start=3000, version="99")]  # unknown to the registry
    for i, v in enumerate(b for batch in batches for b in batch):
        log.append(i % 2, v)
    out = run_increment(config(train_on=train_on), log, registry, LocalTrainJob(), runs,
                        PendingWindow(tmp_path / "p.json"), tmp_path / "w")
    assert out.status == "success" and out.window is not None
    assert out.window.records == (120 if train_on == "champions" else 200)
    assert out.window.offsets == 200, "excluded records are consumed all the same"


def test_an_engine_serving_another_model_fails_the_gate_with_the_mismatch(
        champion: TinyTransformer, tmp_path: Path) -> None:
    """Behaviour log-probabilities from a model other than the parent: measured before the first
    step, recorded, and the candidate is blocked."""
    registry, log, runs = setup(champion, tmp_path)
    torch.manual_seed(9)
    other = TinyTransformer(SMALL)
    for i, v in enumerate(served(other, 100, seed=8)):
        log.append(i % 2, v)
    out = run_increment(config(), log, registry, LocalTrainJob(), runs, PendingWindow(tmp_path / "p.json"),
                        tmp_path / "w")
    assert out.status == "success" and out.version is not None
    assert out.stats["mismatch_tokens"] > 0 and out.stats["mismatch_mean_abs"] > 0.1
    assert runs.runs[out.run_id or ""]["metrics"]["mismatch_mean_abs"] == out.stats["mismatch_mean_abs"]
    reasons = json.loads(registry.get_tags(out.version)[Tag.GATE_REASONS])["reasons"]
    assert any("train-inference mismatch" in r for r in reasons)
    assert registry.alias_version(CANDIDATE) is None
    # the parent's own samples: no mismatch
    registry2, log2, runs2 = setup(champion, tmp_path / "own")
    for i, v in enumerate(served(champion, 100, seed=8)):
        log2.append(i % 2, v)
    own = run_increment(config(), log2, registry2, LocalTrainJob(), runs2,
                        PendingWindow(tmp_path / "p2.json"), tmp_path / "w2")
    assert own.stats["mismatch_mean_abs"] < 1e-4 and own.stats["mismatch_tokens"] > 0
