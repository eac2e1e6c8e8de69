"""The closed loop, shortened: `rtrl demo` in a subprocess on its own embedded stack (real
broker, Redis, MLflow server; real Ray in the trainer; every service its own process).

Asserts at least one automatic promotion and one automatic rollback (the injected bad
candidate), each with a complete ledger run in MLflow, and that no process is left behind.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from services.stack.embedded import EmbeddedStack
from services.stack.supervisor import stop_recorded
from tests.e2e.demo_helpers import NO_HOLDOUT_MEASURE, demo_env, leftovers, run_demo, story

LEDGER_TAGS = ("rtrl.canary.id", "rtrl.candidate_version", "rtrl.stable_version", "rtrl.canary.outcome",
               "rtrl.decision", "rtrl.decision.reason", "rtrl.decided_by", "rtrl.decided_at")


# In CI on 2 cores: about 9 minutes when the first increment is promoted (stack, bootstrap, the
# bad canary, one increment and its canary). One increment in several makes too small a step for
# the judge to decide within the canary's budget, and is aborted; the budget (RTRL_E2E_MINUTES,
# 22) leaves room for a second increment and its canary after that.
@pytest.mark.timeout(1650)
def test_closed_loop_promotes_and_rolls_back_by_itself(tmp_path: Path) -> None:
    data, reports = tmp_path / "demo", tmp_path / "reports"
    env = demo_env({"RTRL_DEMO__TRAINER_CADENCE_S": os.environ.get("RTRL_E2E_CADENCE_S", "60"),
                    "RTRL_DEMO__PROGRESS_EVERY_S": "10", **NO_HOLDOUT_MEASURE})
    minutes = os.environ.get("RTRL_E2E_MINUTES", "22")
    stack = EmbeddedStack(data_dir=data / "stack")
    try:
        proc, out = run_demo(["--minutes", minutes, "--until-promoted", "--increments", "1"], data, reports,
                             env, timeout_s=1590)
        assert proc.returncode == 0, out[-4000:]
        assert not leftovers(data), "a service outlived the demo"

        summary_files = list(reports.glob("*/summary.json"))
        assert len(summary_files) == 1, out[-4000:]
        summary = json.loads(summary_files[0].read_text())
        decisions = summary["decisions"]
        bad = summary["bad_version"]
        promoted = [d for d in decisions if d["outcome"] == "promoted" and d["decided_by"] == "controller"]
        rolled = [d for d in decisions if d["outcome"] == "rolled_back" and d["decided_by"] == "controller"]
        assert promoted, f"no automatic promotion: {decisions}\n{story(data)}\n{out[-3000:]}"
        assert bad and any(d["candidate"] == bad for d in rolled), \
            f"bad v{bad} not rolled back: {decisions}\n{story(data)}"
        assert (summary_files[0].parent / "report.md").read_text().count("rolled back automatically") == 1

        # the ledger in MLflow is complete for each decided canary
        from mlflow import MlflowClient

        stack.load()
        client = MlflowClient(tracking_uri=stack.mlflow_uri)
        exp = client.get_experiment_by_name("rtrl-deployments")
        assert exp is not None
        runs = {r.data.tags.get("rtrl.candidate_version"): r for r in client.search_runs([exp.experiment_id])}
        for d in [promoted[0], *[r for r in rolled if r["candidate"] == bad]]:
            run = runs[d["candidate"]]
            missing = [t for t in LEDGER_TAGS if not run.data.tags.get(t)]
            assert not missing, f"ledger run of v{d['candidate']} lacks {missing}"
            assert run.info.status == "FINISHED"
            assert client.get_metric_history(run.info.run_id, "canary.weight"), "no weight history"
            assert any(k.startswith("cohort.") for k in run.data.metrics), "no cohort evidence"
            tags = client.get_model_version("rtrl-policy", d["candidate"]).tags
            assert tags.get("rtrl.canary.outcome") == d["outcome"]
            assert tags.get("rtrl.decision.reason")
        champion = client.get_model_version_by_alias("rtrl-policy", "champion").version
        assert str(champion) == promoted[-1]["candidate"]
    finally:
        stack.down()
        # belt and braces: nothing from this test may survive it
        stop_recorded(data / "pids.json")
