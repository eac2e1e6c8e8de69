"""THE kill test: real reward worker processes are SIGKILLed mid-batch, at every step of
the commit protocol and at random moments, and restarted; in the end every served request
has exactly one reward record on the rewards topic (read_committed)."""

from __future__ import annotations

import collections
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from reward_helpers import full_edit, interleave, kill_rounds, produce, read_rewards, served

from services.settings.model import Settings
from tests.service_env import service_env


@pytest.fixture
def settings(isolated_settings: Settings) -> Settings:
    """These tests SIGKILL workers: they get a broker and Redis of their own (conftest)."""
    return isolated_settings



def worker_env(settings: Settings, tmp: Path, **extra: str) -> dict[str, str]:
    return service_env(settings, tmp, **{
        "RTRL_REWARD__TIME_SCALE": "0.05",
        "RTRL_REWARD__TRANSACTION_TIMEOUT_MS": "5000",
        "RTRL_REWARD__GROUP_INSTANCE_ID": f"{settings.redis.key_prefix}worker-0",
        **extra,
    })


def start_worker(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    rtrl = Path(sys.executable).parent / "rtrl"
    with open(log, "ab") as out:
        return subprocess.Popen([str(rtrl), "serve", "reward", "--max-batch", "40", "--port", "0"],
                                env=env, stdout=out, stderr=subprocess.STDOUT)


@pytest.mark.reliability  # also part of scripts/reliability (trainer, deployer and worker kills)
def test_exactly_one_reward_per_request_across_sigkills(settings: Settings, tmp_path: Path) -> None:
    rng = random.Random(11)
    edits = [f"e{i}" for i in range(300)]
    # clarifying questions: no feedback, close 3 s (follow-up window x scale) after served.
    # Edits close on their last horizon; nothing here waits for the 181 s due time, so
    # restarts never turn a request whose events are split across batches into an orphan.
    quiet = [f"q{i}" for i in range(100)]
    streams = []
    for i, rid in enumerate(edits):
        evs = full_edit(rid, kept=rng.randint(0, 100))
        if i % 3 == 0:  # the served event may come after the client's feedback
            evs = [*evs[1:], evs[0]]
        streams.append(evs)
    streams += [[served(rid, kind="question")] for rid in quiet]
    events = interleave(streams, rng)
    produce(settings, events[: len(events) // 2])
    log = tmp_path / "workers.log"
    txid = f"{settings.redis.key_prefix}reward-0"
    rounds = [
        # certain: the assertion below needs one after_commit crash, and late in the run few
        # batches still close rewards (drawn at 0.35 here and 0.5 last, none was at times)
        {"RTRL_TEST_REWARD_CRASH": "after_commit:1.0"},
        {"RTRL_TEST_REWARD_CRASH": "mid_txn:0.3"},
        {"RTRL_TEST_REWARD_CRASH": "after_apply:0.3"},
        {},  # killed from outside at a random moment
        {"RTRL_TEST_REWARD_CRASH": "mid_txn:0.5"},
        {"RTRL_TEST_REWARD_CRASH": "after_commit:0.5"},
    ]
    kills = kill_rounds(
        rounds, lambda extra: start_worker(
            worker_env(settings, tmp_path, **{"RTRL_REWARD__TRANSACTIONAL_ID": txid, **extra}), log),
        rng, before=lambda i: produce(settings, events[len(events) // 2:]) if i == 2 else None)
    assert kills >= 4, f"only {kills} of {len(rounds)} workers died by SIGKILL; see {log}"

    final = start_worker(worker_env(settings, tmp_path, RTRL_REWARD__TRANSACTIONAL_ID=txid), log)
    ups = log.read_text().count("reward worker up")
    deadline = time.monotonic() + 30
    while log.read_text().count("reward worker up") == ups and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        records = read_rewards(settings, expect=len(edits) + len(quiet), timeout_s=90, settle_s=3)
    finally:
        final.send_signal(signal.SIGTERM)
        assert final.wait(30) == 0, "SIGTERM must finish the batch and exit 0"
    counts = collections.Counter(r["request_id"] for r in records)
    dupes = {k: v for k, v in counts.items() if v > 1}
    assert not dupes, f"duplicated rewards: {dupes}"
    if set(counts) != set(edits) | set(quiet):
        raw = read_rewards(settings, expect=10**6, timeout_s=5, isolation="read_uncommitted")
        raw_ids = collections.Counter(r["request_id"] for r in raw)
        missing = (set(edits) | set(quiet)) - set(counts)
        raise AssertionError(f"{len(missing)} missing; uncommitted view has {len(raw)} records, "
                             f"{len(raw_ids)} ids, {len(missing & set(raw_ids))} of the missing")
    by_id = {r["request_id"]: r for r in records}
    assert all(by_id[r]["accepted"] is True for r in edits)
    assert all(by_id[r]["defaulted"] for r in quiet)
    text = log.read_text()
    assert "test fault injection: SIGKILL at after_commit" in text
    recovered = [int(line.split(", ")[-1].split()[0]) for line in text.splitlines()
                 if "request ids marked emitted" in line]
    assert any(n > 0 for n in recovered), "no kill landed between the Kafka commit and the Redis mark"
