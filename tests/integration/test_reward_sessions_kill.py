"""The session stage under SIGKILL: reward worker processes with the agent spec are killed
at every step of both stages' commit protocols and at random moments, and restarted; in the
end every served turn has exactly one record, carrying its session's credit."""

from __future__ import annotations

import collections
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from reward_helpers import interleave, kill_rounds, produce, read_rewards
from session_helpers import AGENT_SPEC, generated

from ingest.reward.session_credit import COMPONENTS
from services.settings.model import Settings
from tests.service_env import service_env


def _start(settings: Settings, tmp: Path, log: Path, **extra: str) -> subprocess.Popen[bytes]:
    env = service_env(settings, tmp, **{
        # 0.02: a tool call's request closes 1.2 s after it was seen, an idle session in 36 s
        "RTRL_REWARD__TIME_SCALE": "0.02",
        "RTRL_REWARD__TRANSACTION_TIMEOUT_MS": "5000",
        "RTRL_REWARD__GROUP_INSTANCE_ID": f"{settings.redis.key_prefix}worker-0",
        "RTRL_REWARD__TRANSACTIONAL_ID": f"{settings.redis.key_prefix}reward-0",
        **extra,
    })
    rtrl = Path(sys.executable).parent / "rtrl"
    with open(log, "ab") as out:
        return subprocess.Popen([str(rtrl), "serve", "reward", "--max-batch", "30", "--port", "0",
                                 "--spec", str(AGENT_SPEC)], env=env, stdout=out, stderr=subprocess.STDOUT)


@pytest.mark.reliability
def test_one_record_per_turn_across_sigkills(isolated_settings: Settings, tmp_path: Path) -> None:
    settings = isolated_settings
    rng = random.Random(23)
    streams, owner, ended = generated(40, seed=202, turn_first=True)
    events = interleave(streams, rng)
    produce(settings, events[: len(events) // 2])
    log = tmp_path / "workers.log"
    rounds = [
        {"RTRL_TEST_REWARD_CRASH": "sessions_after_commit:1.0"},
        {"RTRL_TEST_REWARD_CRASH": "after_commit:0.5"},
        {"RTRL_TEST_REWARD_CRASH": "sessions_mid_txn:0.5"},
        {},  # killed from outside at a random moment
        {"RTRL_TEST_REWARD_CRASH": "sessions_after_commit:0.5"},
    ]
    kills = kill_rounds(rounds, lambda extra: _start(settings, tmp_path, log, **extra), rng,
                        before=lambda i: produce(settings, events[len(events) // 2:]) if i == 1 else None)
    assert kills >= 3, f"only {kills} of {len(rounds)} workers died by SIGKILL; see {log}"

    final = _start(settings, tmp_path, log)
    try:
        records = read_rewards(settings, expect=len(owner), timeout_s=120, settle_s=3)
    finally:
        final.send_signal(signal.SIGTERM)
        assert final.wait(30) == 0, "SIGTERM must finish both stages' batches and exit 0"
    counts = collections.Counter(r["request_id"] for r in records)
    assert not {k: v for k, v in counts.items() if v > 1}, "duplicated rewards"
    assert set(counts) == set(owner), f"missing: {sorted(set(owner) - set(counts))[:10]}"
    for r in records:
        assert set(r["components"]) == set(COMPONENTS), r["request_id"]
        assert r["reward"] == pytest.approx(sum(r["components"].values()))
        if r["request_id"] not in ended:
            assert r["components"]["outcome"] == 0.0
    text = log.read_text()
    assert "test fault injection: SIGKILL at sessions_after_commit" in text
    applied = [int(line.split(", ")[-1].split()[0]) for line in text.splitlines()
               if "credited markers applied" in line]
    assert any(n > 0 for n in applied), "no kill landed between the session stage's commit and its marks"
