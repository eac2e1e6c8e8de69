"""``rtrl replay`` against a real broker: the live rewards come from the real reward worker
(in a thread, real Redis); the replay under the live spec reproduces every one of them
exactly, and under a new spec changes the rewards it should and names the new version."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from reward_helpers import T0, accepted, dissatisfied, full_edit, produce, read_rewards, rejected, served

from deployer import ledger
from deployer.actions import LedgerClose, LedgerOpen
from deployer.adapters.ledger_mlflow import MlflowLedger
from ingest.reward.spec import default_spec_text, load_spec
from services.runtime.process import Stopper
from services.settings.model import Settings
from services.settings.services import RewardSettings
from services.wiring.reward import RewardWorker

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def live(settings: Settings) -> Iterator[tuple[Settings, list[dict[str, object]]]]:
    """Forty requests of every kind through the real reward worker; their live records."""
    s = settings.model_copy(update={"reward": RewardSettings(time_scale=0.001, poll_timeout_ms=100)})
    w = RewardWorker(s, load_spec()).start()
    stopper = Stopper()
    t = threading.Thread(target=w.run, args=(stopper,), daemon=True)
    t.start()
    events: list[object] = []
    for i in range(10):
        events += full_edit(f"edit{i}", kept=10 * i)
        events += [served(f"rej{i}", latency_ms=1000.0 * i), rejected(f"rej{i}")]
        events += [served(f"acc{i}", arm="canary"), accepted(f"acc{i}")]
        events += [dissatisfied(f"acc{i}")] if i % 3 == 0 else []
        events += [served(f"q{i}", kind="question")]
    produce(s, events)
    records = read_rewards(s, expect=40, timeout_s=60, settle_s=1.0)
    stopper.stop()
    t.join(10)
    w.close()
    yield s, records


def _replay(s: Settings, tmp_path: Path, *args: str, **env_extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **env_extra, "RTRL_STACK__DATA_DIR": str(tmp_path / "no-stack"),
           "RTRL_KAFKA__BOOTSTRAP_SERVERS": s.kafka.bootstrap_servers, "RTRL_TOPICS__RAW": s.topics.raw,
           "RTRL_TOPICS__EVENTS": s.topics.events, "RTRL_TOPICS__REWARDS": s.topics.rewards}
    return subprocess.run([sys.executable, "-m", "services.cli", "replay", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_replay_reproduces_the_live_rewards_and_shows_a_new_spec(
    live: tuple[Settings, list[dict[str, object]]], tmp_path: Path,
) -> None:
    s, records = live
    assert len(records) == 40
    same = _replay(s, tmp_path, "--spec", str(REPO / "ingest/reward/specs/default.toml"), "--no-canaries",
                   "--json", "--strict", "--out", str(tmp_path / "same.jsonl"))
    assert same.returncode == 0, same.stderr
    doc = json.loads(same.stdout)
    assert doc["check"] == {"records": 40, "reproduced": 40}
    assert doc["rewards"]["changed"] == 0
    lines = (tmp_path / "same.jsonl").read_text().splitlines()
    replayed = {r["request_id"]: r for r in map(json.loads, lines)}
    assert replayed == {r["request_id"]: r for r in records}, "the live spec gives the live records exactly"

    spec = tmp_path / "accept-heavy.toml"
    spec.write_text(default_spec_text().replace('version = "default-v1"', 'version = "accept-heavy-v2"')
                    .replace("accepted = 0.75", "accepted = 1.5"))
    new = _replay(s, tmp_path, "--spec", str(spec), "--no-canaries", "--json",
                  "--out", str(tmp_path / "new.jsonl"))
    assert new.returncode == 0, new.stderr
    doc = json.loads(new.stdout)
    assert doc["spec"] == "accept-heavy-v2" and doc["check"]["reproduced"] == 40
    assert doc["rewards"]["changed"] == 20, "every accepted edit, nothing else"
    assert doc["advantages"]["mean_abs_change"] > 0
    out = {r["request_id"]: r for r in map(json.loads, (tmp_path / "new.jsonl").read_text().splitlines())}
    for rid, rec in out.items():
        was = next(r for r in records if r["request_id"] == rid)
        bonus = 0.75 if was["accepted"] else 0.0
        assert rec["reward"] == pytest.approx(was["reward"] + bonus)  # type: ignore[operator]
        assert rec["reward_spec_version"] == "accept-heavy-v2"

    text = _replay(s, tmp_path, "--spec", str(spec), "--no-canaries", "--out", str(tmp_path / "t.jsonl"))
    assert "the live spec reproduces 40 of 40 live records exactly" in text.stdout
    assert "20 changed" in text.stdout


def test_replay_refuses_what_would_mix_with_live_data(settings: Settings, tmp_path: Path) -> None:
    clash = tmp_path / "clash.toml"
    clash.write_text(default_spec_text().replace("accepted = 0.75", "accepted = 1.5"))  # same version
    proc = _replay(settings, tmp_path, "--spec", str(clash), "--no-canaries")
    assert proc.returncode == 2 and "version of its own" in proc.stderr
    default = str(REPO / "ingest/reward/specs/default.toml")
    proc = _replay(settings, tmp_path, "--spec", default, "--no-canaries", "--topic", settings.topics.rewards)
    assert proc.returncode == 2 and "live topic" in proc.stderr
    dead = settings.kafka.model_copy(update={"bootstrap_servers": "127.0.0.1:1"})
    proc = _replay(settings.model_copy(update={"kafka": dead}), tmp_path, "--spec", default, "--no-canaries")
    assert proc.returncode == 4 and "Traceback" not in proc.stderr and "Kafka" in proc.stderr


def test_replay_judges_past_canaries_from_a_real_ledger(
    live: tuple[Settings, list[dict[str, object]]], mlflow_server: str, tmp_path: Path,
) -> None:
    """A canary recorded in the MLflow ledger (real tracking server) over the live records'
    minutes is judged again with the replayed rewards."""
    s, _ = live
    exp = f"rtrl-deployments-{uuid.uuid4().hex[:6]}"
    cid = f"canary-v1-{uuid.uuid4().hex[:6]}"
    start, end = T0.timestamp() - 60, time.time()
    led = MlflowLedger(mlflow_server, exp)
    led.record(LedgerOpen(cid, ledger.open_params("1", "1", (0.5,), 1.0, 600.0),
                          ledger.open_tags(cid, "canary", "1", "1"), start))
    tags = ledger.decision_tags("promoted", "judge: at least as good", "controller", end)
    led.record(LedgerClose(cid, end, tags, {"canary_id": cid, "decision": "promote"}))
    spec = tmp_path / "rejection-penalty.toml"
    spec.write_text(default_spec_text().replace('version = "default-v1"', 'version = "rej-v3"')
                    .replace("rejected = -0.25", "rejected = -2.0"))
    proc = _replay(s, tmp_path, "--spec", str(spec), "--json", "--out", str(tmp_path / "c.jsonl"),
                   RTRL_MLFLOW__TRACKING_URI=mlflow_server, RTRL_MLFLOW__DEPLOYMENTS_EXPERIMENT=exp)
    assert proc.returncode == 0, proc.stderr
    [canary] = json.loads(proc.stdout)["canaries"]
    assert canary["canary_id"] == cid and canary["outcome"] == "promoted"
    # stable served the edits, rejections and questions (30 users), the canary the accepts (10)
    assert canary["live"]["users"] == [30, 10] == canary["replayed"]["users"]
    # only stable served rejections, so the canary's reward advantage grows under the new spec
    assert canary["replayed"]["reward_difference"] > canary["live"]["reward_difference"] + 0.3
