"""The long-term holdout on real Redis, Kafka and MLflow: operators pin, rotate and end it with
signed commands through the CLI; the gateway's routing key carries it; the deployer measures the
champion against it from the rewards topic and records it in its own ledger run."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from deployer_helpers import deployer_settings, feed_arms, register_versions, with_operators

from deployer.adapters.ledger_mlflow import MlflowLedger
from deployer.adapters.redis_state import ControllerState, RedisRouting
from deployer.adapters.reward_tail import read_holdout_report
from deployer.ledger import TAG_OUTCOME
from deployer.routing import Holdout, parse_table
from ingest.contracts import prometheus as m
from ingest.contracts.registry import NOTE, TAG_HOLDOUT_END, TAG_KIND
from services.cli import holdout as holdout_cli
from services.cli import operator
from services.runtime.redis_io import make_redis
from services.settings.model import Settings
from services.wiring.deployer import build_controller, build_ports, holdout_monitor, reward_reader


@pytest.fixture
def ops(settings: Settings, mlflow_uri: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Settings, dict[str, Path]]]:
    s, tokens = with_operators(deployer_settings(settings, mlflow_uri, holdout_every_s=0.01), tmp_path,
                               "alice")
    monkeypatch.setattr(operator, "get_settings", lambda: s)
    monkeypatch.setattr(holdout_cli, "get_settings", lambda: s)
    yield s, tokens


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = holdout_cli.main(list(argv))
    return code, capsys.readouterr().out


def current(s: Settings) -> Holdout | None:
    return parse_table(RedisRouting(make_redis(s.redis), s.redis.key_prefix).read()).holdout


def test_pin_measure_rotate_and_end_a_holdout(ops: tuple[Settings, dict[str, Path]], tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    s, tokens = ops
    token = ["--by", "alice", "--token-file", str(tokens["alice"])]
    reg = register_versions(s, tmp_path, n=2)
    reg.delete_alias("candidate")
    state = ControllerState(make_redis(s.redis), s.redis.key_prefix)
    state.r.rpush(state.commands_key, b"{not a command")  # hostile queue entry: dropped, blocks nothing

    assert cli(capsys, "status")[1].startswith("holdout      none pinned")
    code, out = cli(capsys, "pin", "--share", "0.6", *token)
    assert code == 1 and "rejected: share 0.6 must lie in (0, 0.5]" in out
    code, out = cli(capsys, "pin", "--share", "0.2", "--days", "2", "--reason", "Q4 baseline", *token)
    assert code == 0 and out.startswith("pinned holdout-v1-"), out
    h = current(s)
    assert h is not None and (h.version, h.share, h.by) == ("1", 0.2, "alice")
    assert h.until - h.started_at == pytest.approx(2 * 86400)
    code, out = cli(capsys, "pin", *token)
    assert code == 1 and f"rejected: holdout {h.id} is active" in out
    forged = tmp_path / "forged"
    forged.write_text("nope")
    code, out = cli(capsys, "end", "--by", "alice", "--token-file", str(forged))
    assert code == 1 and "refused: bad signature" in out and current(s) == h

    # the loop promoted v2 since; the deployer measures v2 against the pinned v1
    reg.set_alias("champion", "2")
    # held-out users on the pinned v1, the champion's users better (persistence +5 pts, latency
    # -10 ms), and canary records that must not count
    feed_arms(s, [("holdout", "1", "stable"), ("stable", "2", "better"), ("canary", "9", "worse")],
              n=300, seed=3)
    controller = build_controller(s, build_ports(s), reward_reader(s),
                                  holdout=holdout_monitor(s, build_ports(s)))
    deadline = time.monotonic() + 60
    rep = None
    while time.monotonic() < deadline:
        assert controller.step() is not None
        rep = read_holdout_report(state.r, s.redis.key_prefix)
        if rep and rep["users"]["holdout"] >= 300 and rep["users"]["champion"] >= 300:
            break
        time.sleep(0.2)
    assert rep is not None and (rep["holdout_id"], rep["champion"], rep["version"]) == (h.id, "2", "1")
    assert rep["users"] == {"holdout": 300, "champion": 300}  # the canary's records are not counted
    persistence, latency = rep["effects"]["persistence"], rep["effects"]["latency_ms"]
    assert 0.03 < persistence["estimate"] < 0.07 and persistence["lower"] > 0.0  # +5 pts, confidently
    assert persistence["relative"] == pytest.approx(persistence["estimate"] / persistence["holdout"])
    assert -14.0 < latency["estimate"] < -6.0 and latency["upper"] < 0.0
    assert m.HOLDOUT_EFFECT.labels("persistence", "estimate")._value.get() == persistence["estimate"]
    code, out = cli(capsys, "status")
    assert code == 0 and "champion v2 vs holdout v1" in out and "persistence" in out, out
    doc = json.loads(cli(capsys, "status", "--json")[1])
    assert doc["holdout"]["id"] == h.id and doc["report"]["effects"]["persistence"]["lower"] > 0

    ledger = MlflowLedger(s.mlflow.tracking_uri, s.mlflow.deployments_experiment)
    run_id = ledger.run_id(h.id)
    assert run_id is not None
    run = ledger.client.get_run(run_id)
    assert run.data.tags[TAG_KIND] == "holdout" and "Q4 baseline" in run.data.tags["rtrl.decision.reason"]
    assert ledger.series(run_id, "holdout.persistence.estimate")
    assert "Long-term holdout: 0.2 of users kept on v1" in run.data.tags[NOTE]
    assert "persistence" in run.data.tags[NOTE]

    code, out = cli(capsys, "rotate", "--share", "0.1", *token)
    assert code == 0 and out.startswith(f"rotated {h.id} into holdout-v2-"), out
    rotated = current(s)
    assert rotated is not None and (rotated.version, rotated.share) == ("2", 0.1) and rotated.salt != h.salt
    old = ledger.client.get_run(run_id)
    assert old.info.status == "FINISHED" and old.data.tags[TAG_OUTCOME] == "ended"
    assert f"rotated into {rotated.id}" in old.data.tags[TAG_HOLDOUT_END]

    code, out = cli(capsys, "end", "--reason", "experiment over", *token)
    assert code == 0 and out.startswith(f"ended holdout {rotated.id}") and current(s) is None
    ended = ledger.client.get_run(ledger.run_id(rotated.id) or "").data.tags
    assert "experiment over" in ended[TAG_HOLDOUT_END]
    assert state.r.llen(state.commands_key) == 0
    controller.step()
    assert m.HOLDOUT_ACTIVE._value.get() == 0.0
