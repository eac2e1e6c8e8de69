"""The registry port on MLflow: one registered model, aliases and version tags (no stages).

A version's policy directory is logged as artifacts of its run under ``policy/`` and
registered with ``create_model_version(source=<run artifact uri>/policy)``, so a plain
directory (manifest + weights) round-trips without any MLflow model flavour.
Works against a tracking server (``http://...``) and a direct ``sqlite:///`` URI alike.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path

import mlflow.artifacts
from ingest.contracts.registry import CHAMPION, FATE, NOTE, TAG_CANARY_ID, Tag
from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException

from deployer import ledger, records

ARTIFACT_PATH = "policy"
"""Where in a run the policy directory is logged."""


def ensure_experiment(client: MlflowClient, name: str, note: str) -> str:
    """The id of experiment ``name``, created when missing. It is shown as a machine-learning
    experiment (``records.EXPERIMENT_KIND``, also set on one an older release made) and
    described by ``note`` unless it already has a description (one edited by hand stays)."""
    exp = client.get_experiment_by_name(name)
    if exp is None:
        try:
            return str(client.create_experiment(name, tags={**records.EXPERIMENT_KIND, NOTE: note}))
        except MlflowException:  # created concurrently
            exp = client.get_experiment_by_name(name)
            if exp is None:
                raise
    missing = {k: v for k, v in records.EXPERIMENT_KIND.items() if exp.tags.get(k) != v}
    if not exp.tags.get(NOTE):
        missing[NOTE] = note
    for key, value in missing.items():
        client.set_experiment_tag(exp.experiment_id, key, value)
    return str(exp.experiment_id)


class MlflowRegistry:
    """:class:`deployer.registry.Registry` backed by the MLflow model registry."""

    def __init__(
        self,
        tracking_uri: str,
        registered_model: str = "rtrl-policy",
        experiment: str = "rtrl-training",
        ledger_experiment: str | None = None,
    ) -> None:
        self.tracking_uri = tracking_uri
        self.name = registered_model
        self.experiment = experiment
        self.ledger_experiment = ledger_experiment
        """The deployments experiment, for the link from a version to its ledger run."""
        self.client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
        self._model_ready = False

    # ------------------------------------------------------------------ helpers
    def _ensure_model(self) -> None:
        if self._model_ready:
            return
        try:
            self.client.create_registered_model(
                self.name, description="rtrl policies: aliases champion, candidate, previous"
            )
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        self._model_ready = True

    def experiment_id(self) -> str:
        """The id of the experiment runs are made in (created when missing)."""
        return ensure_experiment(self.client, self.experiment, records.TRAINING_EXPERIMENT_NOTE)

    def _wait_ready(self, mv: ModelVersion, timeout_s: float = 60.0) -> ModelVersion:
        deadline = time.monotonic() + timeout_s
        while mv.status == "PENDING_REGISTRATION" and time.monotonic() < deadline:
            time.sleep(0.2)
            mv = self.client.get_model_version(self.name, str(mv.version))
        if mv.status != "READY":
            raise RuntimeError(f"model version {mv.version} is {mv.status}: {mv.status_message}")
        return mv

    # ------------------------------------------------------------------ the port
    def register(
        self, run_id: str | None, policy_dir: str | Path, tags: Mapping[str, str] | None = None
    ) -> str:
        src = Path(policy_dir)
        if not src.is_dir():
            raise FileNotFoundError(f"policy directory {src} does not exist")
        self._ensure_model()
        own_run = not run_id
        if not run_id:
            run_id = self.client.create_run(self.experiment_id()).info.run_id
        self.client.log_artifacts(run_id, str(src), artifact_path=ARTIFACT_PATH)
        artifact_uri = self.client.get_run(run_id).info.artifact_uri
        mv = self.client.create_model_version(
            self.name,
            source=f"{artifact_uri.rstrip('/')}/{ARTIFACT_PATH}",
            run_id=run_id,
            tags={Tag.RUN_ID: run_id, FATE: records.NEVER_OFFERED,
                  **{k: str(v) for k, v in (tags or {}).items()}},
        )
        if own_run:
            self.client.set_terminated(run_id)
        version = str(self._wait_ready(mv).version)
        self.describe(version)
        return version

    def set_alias(self, alias: str, version: str) -> None:
        self.client.set_registered_model_alias(self.name, alias, str(version))
        if alias == CHAMPION:
            self.index()

    def delete_alias(self, alias: str) -> None:
        if self.alias_version(alias) is None:
            return
        try:
            self.client.delete_registered_model_alias(self.name, alias)
        except MlflowException as exc:  # removed concurrently
            if exc.error_code not in {"RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"}:
                raise

    def alias_version(self, alias: str) -> str | None:
        try:
            model = self.client.get_registered_model(self.name)
        except MlflowException as exc:
            if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
                return None
            raise
        version = (model.aliases or {}).get(alias)
        return None if version is None else str(version)

    def set_tags(self, version: str, tags: Mapping[str, str]) -> None:
        for key, value in tags.items():
            self.client.set_model_version_tag(self.name, str(version), key, str(value))
        self.describe(version)

    # ------------------------------------------------------------------ records
    def describe(self, version: str) -> None:
        """Rewrite the version's description from its tags (deployer/records.py), with links
        to its training run and its latest ledger run."""
        mv = self.client.get_model_version(self.name, str(version))
        tags = {k: str(v) for k, v in (mv.tags or {}).items()}
        links = self._run_link(mv.run_id), self._ledger_link(tags.get(TAG_CANARY_ID))
        text = ledger.clip(records.version_description(self.name, str(version), tags, *links))
        if text != (mv.description or ""):
            self.client.update_model_version(self.name, str(version), description=text)
        self.index()

    def index(self) -> None:
        """Rewrite the registered model's description, the index of its versions
        (deployer/records.py ``model_index``)."""
        model = self.client.get_registered_model(self.name)
        versions = [(str(mv.version), {k: str(v) for k, v in (mv.tags or {}).items()})
                    for mv in self.client.search_model_versions(f"name = '{self.name}'")]
        champion = (model.aliases or {}).get(CHAMPION)
        text = ledger.clip(records.model_index(self.name, None if champion is None else str(champion),
                                               versions, self._ledger_links()))
        if text != (model.description or ""):
            self.client.update_registered_model(self.name, description=text)

    def _ledger_links(self) -> dict[str, str]:
        """Canary id -> its ledger run's link, for every canary in the deployments experiment."""
        if not self.ledger_experiment:
            return {}
        exp = self.client.get_experiment_by_name(self.ledger_experiment)
        if exp is None:
            return {}
        runs = self.client.search_runs([exp.experiment_id], max_results=1000)
        return {r.data.tags[TAG_CANARY_ID]: records.run_link(exp.experiment_id, r.info.run_id)
                for r in runs if TAG_CANARY_ID in r.data.tags}

    def _run_link(self, run_id: str | None) -> str | None:
        if not run_id:
            return None
        try:
            return records.run_link(self.client.get_run(run_id).info.experiment_id, run_id)
        except MlflowException:  # the run was deleted: no link
            return None

    def _ledger_link(self, canary_id: str | None) -> str | None:
        if not canary_id or not self.ledger_experiment:
            return None
        exp = self.client.get_experiment_by_name(self.ledger_experiment)
        if exp is None:
            return None
        found = self.client.search_runs([exp.experiment_id], max_results=1,
                                        filter_string=f"tags.`rtrl.canary.id` = '{canary_id}'")
        return records.run_link(exp.experiment_id, found[0].info.run_id) if found else None

    def get_tags(self, version: str) -> dict[str, str]:
        try:
            mv = self.client.get_model_version(self.name, str(version))
        except MlflowException as exc:
            if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
                raise KeyError(f"no version {version} of {self.name}") from exc
            raise
        return {k: str(v) for k, v in (mv.tags or {}).items()}

    def download(self, version: str, dst_dir: str | Path) -> Path:
        uri = self.client.get_model_version_download_uri(self.name, str(version))
        dst = Path(dst_dir)
        dst.mkdir(parents=True, exist_ok=True)
        local = Path(
            mlflow.artifacts.download_artifacts(
                artifact_uri=uri, dst_path=str(dst), tracking_uri=self.tracking_uri
            )
        )
        if not (local / "policy.json").exists():
            raise FileNotFoundError(f"version {version} at {uri} holds no policy.json")
        return local

    def versions(self) -> list[str]:
        found = self.client.search_model_versions(f"name = '{self.name}'")
        return sorted((str(mv.version) for mv in found), key=int)

    def run_id(self, version: str) -> str | None:
        """The run a version was registered from."""
        run_id = self.client.get_model_version(self.name, str(version)).run_id
        return str(run_id) if run_id else None
