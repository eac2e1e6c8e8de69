"""The registry contract (tests/unit/test_trainer_registry.py) against real MLflow: a direct
sqlite store (versions come back as ints there) and a tracking server over REST (strings)."""

from __future__ import annotations

import importlib.util
import uuid
from pathlib import Path

import pytest

from deployer import records
from deployer.adapters.ledger_mlflow import MlflowLedger
from deployer.adapters.mlflow_registry import MlflowRegistry
from deployer.registry import Registry
from ingest.contracts.registry import CHAMPION, NOTE, RUN_OUTCOME
from trainer.adapters.mlflow_runs import MlflowRunTracker
from trainer.registration import close_interrupted

_spec = importlib.util.spec_from_file_location(
    "trainer_registry_contract", Path(__file__).parents[1] / "unit" / "test_trainer_registry.py"
)
assert _spec and _spec.loader
contract = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(contract)


@pytest.fixture(scope="module")
def sqlite_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One sqlite store per module: creating its tables takes seconds."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


class TestMlflowRegistrySqlite(contract.RegistryContract):  # type: ignore[name-defined,misc]
    @pytest.fixture
    def registry(self, sqlite_uri: str) -> Registry:
        return MlflowRegistry(sqlite_uri, f"rtrl-policy-{uuid.uuid4().hex[:8]}", "rtrl-training")


class TestMlflowRegistryServer(contract.RegistryContract):  # type: ignore[name-defined,misc]
    @pytest.fixture
    def registry(self, mlflow_server: str) -> Registry:
        # one server for the session: a fresh registered model per test keeps tests apart
        return MlflowRegistry(mlflow_server, f"rtrl-policy-{uuid.uuid4().hex[:8]}", "rtrl-training")


def test_versions_are_linked_to_their_runs(sqlite_uri: str, tmp_path: Path) -> None:
    reg = MlflowRegistry(sqlite_uri)
    run_id = reg.client.create_run(reg.experiment_id()).info.run_id
    v = reg.register(run_id, contract.make_policy_dir(tmp_path, "x"))
    assert reg.run_id(v) == run_id
    reg.set_alias(CHAMPION, v)
    # a second adapter instance (another process) sees the same alias
    assert MlflowRegistry(reg.tracking_uri).alias_version(CHAMPION) == v


def test_an_interrupted_increment_run_is_closed_as_killed_on_the_real_server(mlflow_server: str) -> None:
    """The run tracker finds a window's run still RUNNING on a real tracking server and the
    retry closes it KILLED, with its outcome and a description naming its successor."""
    runs = MlflowRunTracker(mlflow_server, f"rtrl-training-{uuid.uuid4().hex[:8]}")
    name = "increment-w-test"
    left = runs.start(name, {}, {})
    runs.start("increment-w-other", {}, {})
    retry = runs.start(name, {}, {})
    assert set(runs.open_runs(name)) == {left, retry}
    assert close_interrupted(runs, name, retry) == [left]
    run = runs.client.get_run(left)
    assert run.info.status == "KILLED" and run.info.end_time is not None
    assert run.data.tags[RUN_OUTCOME] == "interrupted"
    assert retry in run.data.tags[NOTE]
    assert runs.open_runs(name) == [retry]
    runs.log_text(retry, "version = 'x'\n", "reward_spec.toml")  # the spec file an increment logs
    spec = runs.client.download_artifacts(retry, "reward_spec.toml")
    assert Path(spec).read_text() == "version = 'x'\n"


def test_both_experiments_say_what_they_hold_and_a_hand_edited_description_stays(mlflow_server: str) -> None:
    """The training and deployments experiments open as machine-learning experiments with a
    description telling reviewers what their runs are; one made by an older release gets
    both, and a description an operator wrote is not overwritten."""
    suffix = uuid.uuid4().hex[:8]
    runs = MlflowRunTracker(mlflow_server, f"rtrl-training-{suffix}")
    ledger = MlflowLedger(mlflow_server, f"rtrl-deployments-{suffix}")
    for exp_id, note in ((runs.experiment_id(), records.TRAINING_EXPERIMENT_NOTE),
                         (ledger.experiment_id(), records.LEDGER_EXPERIMENT_NOTE)):
        tags = runs.client.get_experiment(exp_id).tags
        assert tags[NOTE] == note and "Model training" in note
        assert tags["mlflow.experimentKind"] == "custom_model_development"
    old = runs.client.create_experiment(f"rtrl-old-{suffix}")  # as an older release made it
    assert MlflowRegistry(mlflow_server, experiment=f"rtrl-old-{suffix}").experiment_id() == old
    tags = runs.client.get_experiment(old).tags
    assert tags[NOTE] == records.TRAINING_EXPERIMENT_NOTE and tags["mlflow.experimentKind"]
    runs.client.set_experiment_tag(old, NOTE, "ours")
    assert MlflowRunTracker(mlflow_server, f"rtrl-old-{suffix}").experiment_id() == old
    assert runs.client.get_experiment(old).tags[NOTE] == "ours"
