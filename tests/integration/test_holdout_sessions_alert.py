"""The long-term holdout of an agent product, from reward records to a firing alert.

A deployer runs as its own process (``rtrl serve deployer``) under the agent reward spec (a
``[session]`` table), on the session's broker, Redis and MLflow server. The holdout is pinned
on v1 through the operators' CLI, v2 is the champion, and the rewards topic gets session-credited
records (one per turn, the first the session's lead, as the session stage writes them) in which
the champion's users complete fewer of their sessions than the held-out users, while every
per-request figure (reward, latency, follow-ups) has one distribution in both arms. Debian's
``prometheus`` scrapes the deployer and evaluates the chart's canary rules, with only the
holdout rule's ``for: 30m`` shortened. Checked: ``RtrlHoldoutRegression`` fires for
``session_completion`` and for no per-request metric, and the exported interval is the one the
deployer wrote to Redis.

The records come from a generator of this file (users with one to four sessions, geometric
turns), not from the judge's test generators."""

from __future__ import annotations

import random
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from deployer_helpers import deployer_settings, register_versions, with_operators

from deployer.adapters.reward_tail import read_holdout_report
from ingest.events import CreditedSession, ModelRef, RewardRecord
from services.cli import holdout as holdout_cli
from services.runtime.kafka_io import ensure_topics, make_producer
from services.runtime.redis_io import make_redis
from services.settings.model import Settings
from services.stack.embedded import free_port
from services.stack.supervisor import ProcSpec, Supervisor, serve_argv
from tests.live_alerts import ALERTS, Prometheus, live_env, operator_targets, prometheus_binary, wait

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

REPO = Path(__file__).resolve().parents[2]
AGENT_SPEC = REPO / "ingest" / "reward" / "specs" / "agent.toml"
HOLD = ("rtrl_holdout_active == 1\n        for: 30m", "rtrl_holdout_active == 1\n        for: 5s")
"""The one change to the shipped rules: the holdout rule's duration."""
USERS = 200
"""Users per arm."""
P_COMPLETE = {"holdout": 0.62, "stable": 0.36}
"""Each arm's chance that a session completes: the champion completes fewer."""


def session_records(arm: str, version: str, rng: random.Random) -> list[RewardRecord]:
    """The arm's users' sessions as credited reward records, served now."""
    now = datetime.now(UTC)
    out = []
    for u in range(USERS):
        user = f"{arm}-u{u}"
        for n in range(rng.randint(1, 4)):
            sid = f"{user}-s{n}-{uuid.uuid4().hex[:6]}"
            turns = 1
            while turns < 12 and rng.random() < 0.7:
                turns += 1
            done = rng.random() < P_COMPLETE[arm]
            status = "completed" if done else rng.choice(["abandoned", "handed_back", "timed_out"])
            invalid = rng.choice([0, 0, 0, 1])
            for t in range(turns):
                rid = f"{sid}-t{t}"
                out.append(RewardRecord(
                    request_id=rid, served_event_id=f"{rid}-s", session_id=sid, user_key=user,
                    served_ts=now, closed_ts=now, model=ModelRef(name="rtrl-policy", version=version),
                    arm=arm,  # type: ignore[arg-type]
                    prompt_tokens=[1, 2, 3], completion_tokens=[4, 5, 6, 7], behavior_logprobs=[-0.7] * 4,
                    latency_ms=max(1.0, rng.gauss(300.0, 40.0)), completion_kind="tool_call", tool_calls=1,
                    reward=rng.gauss(0.1, 0.3), components={}, reward_spec_version="agent-v1",
                    session_credit=CreditedSession(turn=t, turns=turns, status=status,  # type: ignore[arg-type]
                                                   invalid_tool_calls=invalid, lead=t == 0)))
    return out


def feed(s: Settings, records: list[RewardRecord]) -> None:
    ensure_topics(s, [s.topics.rewards])
    producer = make_producer(s.kafka)
    try:
        for rec in records:
            producer.send(s.topics.rewards, key=rec.request_id.encode(), value=rec.model_dump_json().encode())
        producer.flush(30)
    finally:
        producer.close()


def rules(dest: Path) -> list[str]:
    text = (ALERTS / "canary.yaml").read_text()
    assert HOLD[0] in text, "the holdout rule's duration changed: update HOLD"
    (dest / "canary.yaml").write_text(text.replace(HOLD[0], HOLD[1]))
    return [str(dest / "canary.yaml")]


def holdout_alerts(alerts: list[dict[str, Any]]) -> dict[str, str]:
    """metric -> state of every RtrlHoldoutRegression pending or firing."""
    return {a["labels"]["metric"]: a["state"] for a in alerts
            if a["labels"].get("alertname") == "RtrlHoldoutRegression"}


def test_a_champion_that_completes_fewer_sessions_than_the_holdout_fires_the_holdout_alert(
        settings: Settings, mlflow_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    prom_binary = prometheus_binary()
    s, tokens = with_operators(deployer_settings(settings, mlflow_server), tmp_path, "alice")
    s = s.model_copy(update={"reward_spec": AGENT_SPEC})
    monkeypatch.setattr(holdout_cli, "get_settings", lambda: s)
    reg = register_versions(s, tmp_path, n=2)
    reg.delete_alias("candidate")
    code = holdout_cli.main(["pin", "--share", "0.2", "--by", "alice", "--token-file", str(tokens["alice"])])
    assert code == 0, capsys.readouterr().out
    reg.set_alias("champion", "2")  # the loop promoted v2 since the pin
    rng = random.Random(20261207)
    feed(s, session_records("holdout", "1", rng) + session_records("stable", "2", rng))

    port, prom_port = free_port(), free_port()
    env = live_env(s, mlflow_server, tmp_path, free_port(),
                   RTRL_MLFLOW__REGISTERED_MODEL=s.mlflow.registered_model,
                   RTRL_MLFLOW__DEPLOYMENTS_EXPERIMENT=s.mlflow.deployments_experiment,
                   RTRL_REWARD_SPEC=str(AGENT_SPEC), RTRL_DEPLOYER__HOLDOUT_EVERY_S="1",
                   RTRL_DEPLOYER__TICK_S="1", RTRL_DEPLOYER__JUDGE_MIN_USERS="30",
                   RTRL_HTTP__PORT=str(port))
    (tmp_path / "rules").mkdir()
    prom_proc = Prometheus(prom_binary, tmp_path, prom_port, operator_targets({"deployer": port}),
                           rules(tmp_path / "rules"))
    prom = prom_proc.api
    sup = Supervisor(tmp_path / "logs", env)
    try:
        sup.start(ProcSpec("deployer", serve_argv("deployer")))
        wait(lambda: prom.value('rtrl_holdout_users{arm="champion"}') >= USERS, 180,
             "the deployer did not measure the champion against the holdout", sup)
        wait(lambda: holdout_alerts(prom.alerts()).get("session_completion") == "firing", 90,
             f"RtrlHoldoutRegression did not fire for session_completion: {prom.alerts()}", sup)
        time.sleep(3)  # a few more evaluations: nothing else turns up
        assert holdout_alerts(prom.alerts()) == {"session_completion": "firing"}

        rep = read_holdout_report(make_redis(s.redis), s.redis.key_prefix)
        assert rep is not None and rep["champion"] == "2" and rep["version"] == "1"
        completion = rep["effects"]["session_completion"]
        assert completion["upper"] < 0 < completion["holdout"]
        exported = prom.value('rtrl_holdout_effect{metric="session_completion",stat="upper"}')
        assert exported == pytest.approx(completion["upper"], abs=1e-9)
        turns = rep["effects"]["turns_per_completed"]
        assert turns["lower"] <= 0 <= turns["upper"]  # one turn distribution: not shown different
    finally:
        sup.stop_all(grace_s=10)
        prom_proc.stop()
