"""What a product reviewer reads in MLflow after real decisions on the session's MLflow
server: version descriptions and fates, the ledger run's description and comparison.csv,
links both ways, and the experiment kind that opens the ledger on its runs."""

from __future__ import annotations

import csv
from pathlib import Path

from deployer_helpers import deployer_settings, operator_command, rolled_back_canary, with_operators

from deployer import records
from deployer.adapters.ledger_mlflow import COMPARISON_ARTIFACT, MlflowLedger
from deployer.adapters.mlflow_registry import MlflowRegistry
from deployer.controller import Controller
from deployer.status import Phase
from ingest.contracts.registry import CHAMPION_SINCE, FATE, NOTE
from services.settings.model import Settings


def test_versions_and_ledger_runs_describe_each_other(settings: Settings, mlflow_server: str,
                                                      tmp_path: Path) -> None:
    deploy, tokens = with_operators(deployer_settings(settings, mlflow_server), tmp_path, "alice")
    controller, cid = rolled_back_canary(deploy, tmp_path)
    assert isinstance(controller, Controller)
    reg = controller.ports.registry
    assert isinstance(reg, MlflowRegistry)
    led = MlflowLedger(mlflow_server, deploy.mlflow.deployments_experiment)
    run_id = led.run_id(cid)
    assert run_id is not None
    exp_id = led.experiment_id()
    model = deploy.mlflow.registered_model

    # the experiment opens on runs, not GenAI traces
    assert led.client.get_experiment(exp_id).tags["mlflow.experimentKind"] == "custom_model_development"

    # the rolled-back version: fate, description with links to its ledger run and training run
    mv = reg.client.get_model_version(model, "2")
    assert mv.tags[FATE] == records.ROLLED_BACK
    training = reg.client.get_run(mv.run_id)
    assert mv.description.startswith("rtrl policy v2: rolled back")
    assert f"[{cid}]({records.run_link(exp_id, run_id)}): rolled_back" in mv.description
    assert f"({records.run_link(training.info.experiment_id, mv.run_id)})" in mv.description
    assert f"trained from [v1](#/models/{model}/versions/1)" in mv.description
    assert "| reward spec | test-1 |" in mv.description and "| offline gate | **pass** |" in mv.description

    # the ledger run: the decision in words, links back, one line per judged metric, the table
    run = led.client.get_run(run_id)
    note = run.data.tags[NOTE]
    assert note.startswith("v2 was rolled back: v1 stays the champion.")
    assert f"candidate [v2](#/models/{model}/versions/2)" in note
    assert f"stable [v1](#/models/{model}/versions/1)" in note
    assert f"[training run]({records.run_link(training.info.experiment_id, mv.run_id)})" in note
    assert "- reward: stable " in note and "always-valid interval [" in note
    assert run.info.run_name == "v2 rolled back by controller", "the run list says what happened"
    assert run.data.tags["mlflow.user"] == "controller", "MLflow's Created by is the decider"
    verdict, reasons = records.verdict_and_reasons(run.data.tags)
    assert verdict == "judge: canary worse" and reasons, run.data.tags
    assert note.index(f"- {reasons[0]}") < note.index("- reward: stable "), "reasons above the figures"
    table = Path(led.client.download_artifacts(run_id, COMPARISON_ARTIFACT)).read_text()
    rows = {r["metric"]: r for r in csv.DictReader(table.splitlines())}
    reward = rows["reward"]
    assert reward["source"] == "judge" and float(reward["delta"]) < 0
    assert float(reward["ci_lower"]) <= float(reward["delta"]) <= float(reward["ci_upper"])
    assert float(reward["stable"]) > float(reward["canary"])
    assert rows["reward_mean"]["source"] == "cohort"

    # a later promotion by hand: the old champion superseded, its description updated
    src = tmp_path / "policy"
    v3 = reg.register(None, src, tags={"rtrl.gate.result": "pass", "rtrl.parent_version": "1"})
    assert reg.client.get_model_version(model, v3).tags[FATE] == records.NEVER_OFFERED
    controller.ports.state.push(operator_command(tokens, "alice", "promote", v3))
    status = controller.step()
    assert status is not None and status.phase == Phase.SUCCEEDED
    new, old = (reg.client.get_model_version(model, v) for v in (v3, "1"))
    assert new.tags[FATE] == records.PROMOTED and old.tags[FATE] == records.SUPERSEDED
    assert new.description.startswith(f"rtrl policy v{v3}: champion")
    assert f"| champion | since {new.tags[CHAMPION_SINCE]} |" in new.description
    assert old.description.startswith("rtrl policy v1: former champion, superseded")
    assert f"(superseded by [v{v3}](#/models/{model}/versions/{v3}))" in old.description

    # the registered model: the champion now and a row per version, with its canary's ledger run
    index = reg.client.get_registered_model(model).description
    assert index.startswith(f"rtrl policies. Champion now: [v{v3}](#/models/{model}/versions/{v3}).")
    assert f"| [v2](#/models/{model}/versions/2) | rolled back | rollback |" in index
    assert f"[{cid}]({records.run_link(exp_id, run_id)})" in index
    assert f"| [v{v3}](#/models/{model}/versions/{v3}) | champion | promote |" in index
    assert "| alice |" in index
    promote_run = led.client.get_run(led.run_id(status.canary_id or "") or "")
    assert promote_run.data.tags[NOTE].startswith(f"v{v3} was promoted: it is the champion now")
    assert promote_run.info.run_name == f"v{v3} promoted by alice"
    assert promote_run.data.tags["mlflow.user"] == "alice"
