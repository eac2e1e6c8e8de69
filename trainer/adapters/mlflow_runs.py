"""Experiment tracking on MLflow: one run per increment (or bootstrap) in the training
experiment, with parameters, metrics over steps, lineage tags and final figures."""

from __future__ import annotations

import time
from collections.abc import Sequence

from deployer.adapters.mlflow_registry import ensure_experiment
from deployer.records import TRAINING_EXPERIMENT_NOTE
from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunTag

STEP_KEYS = ("loss", "pg_loss", "kl", "kl_per_token", "clip_fraction", "ess", "truncated_fraction",
             "ratio_mean", "ratio_max", "behavior_ratio_mean", "grad_norm", "step_seconds", "tokens",
             "probe_kl", "lr")


class MlflowRunTracker:
    """:class:`trainer.registration.RunTracker` on MLflow."""

    def __init__(self, tracking_uri: str, experiment: str) -> None:
        self.client = MlflowClient(tracking_uri=tracking_uri)
        self.experiment = experiment
        self._experiment_id: str | None = None

    def experiment_id(self) -> str:
        if self._experiment_id is None:
            self._experiment_id = ensure_experiment(self.client, self.experiment, TRAINING_EXPERIMENT_NOTE)
        return self._experiment_id

    def start(self, name: str, params: dict[str, str], tags: dict[str, str]) -> str:
        run = self.client.create_run(self.experiment_id(), run_name=name, tags=tags)
        run_id = str(run.info.run_id)
        if params:
            self.client.log_batch(run_id, params=[Param(k, str(v)) for k, v in params.items()])
        return run_id

    def log_steps(self, run_id: str, history: Sequence[dict[str, float]]) -> None:
        now = int(time.time() * 1000)
        metrics = [
            Metric(k, float(h[k]), now, int(h.get("step", i + 1)))
            for i, h in enumerate(history) for k in STEP_KEYS if k in h
        ]
        for i in range(0, len(metrics), 900):  # MLflow accepts at most 1000 metrics per batch
            self.client.log_batch(run_id, metrics=metrics[i : i + 900])

    def finish(self, run_id: str, status: str, metrics: dict[str, float], tags: dict[str, str]) -> None:
        now = int(time.time() * 1000)
        finite = {k: v for k, v in metrics.items() if v == v and abs(v) != float("inf")}
        self.client.log_batch(run_id, metrics=[Metric(k, float(v), now, 0) for k, v in finite.items()],
                              tags=[RunTag(k, v) for k, v in tags.items()])
        self.client.set_terminated(run_id, status=status)

    def open_runs(self, name: str) -> list[str]:
        found = self.client.search_runs([self.experiment_id()], "attributes.status = 'RUNNING'",
                                        max_results=1000)
        return [r.info.run_id for r in found if r.info.run_name == name]

    def log_text(self, run_id: str, text: str, name: str) -> None:
        self.client.log_text(run_id, text, name)
