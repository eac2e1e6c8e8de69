"""``rtrl sample``: with the broker down, one line and exit code 4 within seconds; ``--json``
prints the text summary's facts as one JSON document (built by :func:`summary`)."""

from __future__ import annotations

import collections
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from services.cli import exit_codes
from services.cli.sample import summary

ROOT = Path(__file__).resolve().parents[2]


def _reward(arm: str, reward: float, accepted: bool | None, defaulted: bool = False) -> dict[str, Any]:
    return {"request_id": f"r-{arm}-{reward}", "arm": arm, "reward": reward, "accepted": accepted,
            "defaulted": defaulted, "completion_kind": "edit", "components": {"persistence": reward},
            "model": {"version": "1"}, "reward_spec_version": "v1"}


def test_broker_down_is_one_line_and_exit_4(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {k: v for k, v in os.environ.items() if not k.startswith("RTRL_")}
    env = {**base, "PYTHONPATH": str(ROOT), "RTRL_STACK__DATA_DIR": str(tmp_path / "stack"),
           "RTRL_KAFKA__BOOTSTRAP_SERVERS": f"127.0.0.1:{port}"}
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "services.cli", "sample", "--json"], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == exit_codes.UNAVAILABLE, p.stderr
    assert time.monotonic() - t0 < 10.0 and p.stdout == "" and "Traceback" not in p.stderr
    (line,) = p.stderr.strip().splitlines()
    assert line.startswith(f"rtrl sample: Kafka at 127.0.0.1:{port} did not answer within 3s "
                           "(set RTRL_KAFKA__BOOTSTRAP_SERVERS)")


def test_summary_has_the_facts_of_the_text_summary() -> None:
    rewards = [_reward("stable", 1.0, True), _reward("stable", 0.0, False),
               _reward("canary", 0.5, None, defaulted=True)]
    doc = json.loads(json.dumps(summary(12, 9, collections.Counter({"schema": 2, "duplicate": 1}),
                                        rewards, 4)))
    assert doc["events_sent"] == 12 and doc["forwarded_by_ingest"] == 9
    assert doc["dead_lettered"] == 3 and doc["dead_lettered_by_reason"] == {"duplicate": 1, "schema": 2}
    assert doc["rewards_emitted"] == 3 and doc["served_completions"] == 4
    assert doc["mean_reward_by_arm"] == {"canary": {"mean": 0.5, "n": 1}, "stable": {"mean": 0.5, "n": 2}}
    assert doc["rewards_by_outcome"] == {"accepted": 1, "no feedback (default)": 1, "rejected": 1}
    assert [r["request_id"] for r in doc["example_rewards"]] == [r["request_id"] for r in rewards]


def test_the_text_summary_prints_the_same_document(capsys: pytest.CaptureFixture[str]) -> None:
    from services.cli.sample import _print_summary

    rewards = [_reward("stable", 1.0, True), _reward("canary", 0.5, None, defaulted=True)]
    _print_summary(summary(12, 9, collections.Counter({"schema": 2}), rewards, 4))
    out = capsys.readouterr().out
    assert "events sent         12" in out and "dead-lettered       2\n  schema" in out
    assert "rewards emitted     2 of 4 served completions" in out
    assert "mean reward canary  +0.500  (n=1)" in out and "mean reward stable  +1.000  (n=1)" in out
    assert "by outcome: accepted 1, no feedback (default) 1" in out
    assert out.count(" reward +") == 2  # both examples
