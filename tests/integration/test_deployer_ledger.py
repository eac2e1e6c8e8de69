"""The MLflow decision ledger on a sqlite store and on a tracking server (REST): every ledger
event applied twice leaves exactly what applying it once leaves."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from deployer import ledger
from deployer.actions import LedgerClose, LedgerNote, LedgerOpen, LedgerStep
from deployer.adapters.ledger_mlflow import COMPARISON_ARTIFACT, PLOT_ARTIFACT, SUMMARY_ARTIFACT, MlflowLedger

T = 1_800_000_000.0


@pytest.fixture(params=["sqlite", "server"])
def tracking_uri(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "server":
        yield request.getfixturevalue("mlflow_server")
        return
    cwd = Path.cwd()
    os.chdir(tmp_path)  # the sqlite store puts artifacts under ./mlruns
    try:
        yield f"sqlite:///{tmp_path / 'mlflow.db'}"
    finally:
        os.chdir(cwd)


def events(cid: str) -> list[object]:
    tags = ledger.decision_tags("rolled_back", "judge: canary worse", "controller", T + 30)
    return [
        LedgerOpen(cid, ledger.open_params("2", "1", (0.1, 0.5), 1.0, 60.0),
                   ledger.open_tags(cid, "canary", "2", "1"), T),
        *[LedgerStep(cid, i, T + i, ledger.step_metrics(0.1, "continue", {"stable.reward_mean": 0.5,
                                                                          "canary.reward_mean": 0.5 - i / 10},
                                                        {"reward.p_value": 1.0 / i}, False))
          for i in (1, 2, 3)],
        LedgerNote(cid, "rtrl.operator.x1", "paused by alice"),
        LedgerClose(cid, T + 30, tags, {"canary_id": cid, "decision": "rollback"}),
    ]


def test_every_ledger_event_is_idempotent(tracking_uri: str) -> None:
    cid = f"canary-v2-{uuid.uuid4().hex[:8]}"
    exp = f"rtrl-deployments-{uuid.uuid4().hex[:6]}"
    for _ in range(2):
        fresh = MlflowLedger(tracking_uri, exp)  # a restarted controller: nothing cached
        for event in events(cid):
            fresh.record(event)  # type: ignore[arg-type]
    led = MlflowLedger(tracking_uri, exp)
    (row,) = led.history()
    assert row["canary_id"] == cid and row["decision"] == "rollback" and row["decided_by"] == "controller"
    run = led.client.get_run(row["run_id"])
    assert run.info.status == "FINISHED" and run.info.end_time == int((T + 30) * 1000)
    assert run.data.tags["rtrl.canary.id"] == cid and run.info.run_name.endswith("rolled back by controller")
    assert run.data.params["steps"] == "0.1,0.5"
    assert run.data.tags["rtrl.operator.x1"] == "paused by alice"
    assert run.data.tags[ledger.TAG_OUTCOME] == "rolled_back"
    p_values = led.series(row["run_id"], "judge.reward.p_value")
    assert p_values == [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3))]
    assert len(led.series(row["run_id"], "cohort.canary.reward_mean")) == 3
    files = {a.path for a in led.client.list_artifacts(row["run_id"])}
    assert files == {PLOT_ARTIFACT, SUMMARY_ARTIFACT, COMPARISON_ARTIFACT}
    assert run.data.tags["mlflow.note.content"].startswith("v2 was rolled back: v1 stays the champion.")
    assert "- reward: stable " not in run.data.tags["mlflow.note.content"], "no judged metric was logged"
    summary = json.loads(Path(led.client.download_artifacts(row["run_id"], SUMMARY_ARTIFACT)).read_text())
    assert summary == {"canary_id": cid, "decision": "rollback"}
