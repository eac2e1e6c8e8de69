"""The decision ledger on MLflow: one run per canary in the deployments experiment.

The run is found by its tag ``rtrl.canary.id`` (= its run name), so every ledger event is
idempotent: opening twice finds the run, a step re-logged with the same timestamp, step
and value is deduplicated by MLflow, tags and artifacts are overwritten with the same
content, and ending a finished run again changes nothing.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ingest.contracts.registry import NOTE, TAG_CANARY_ID, TAG_CANDIDATE, TAG_DECIDED_AT, TAG_KIND, TAG_STABLE
from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException

from deployer import holdout, ledger, records
from deployer.actions import LedgerClose, LedgerEvent, LedgerNote, LedgerOpen, LedgerRefusal, LedgerStep
from deployer.adapters.mlflow_registry import ensure_experiment

PLOT_ARTIFACT = "cohorts.png"
SUMMARY_ARTIFACT = "decision.json"
COMPARISON_ARTIFACT = "comparison.csv"
PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward (mean)", ("cohort.stable.reward_mean", "cohort.canary.reward_mean")),
    ("acceptance", ("cohort.stable.acceptance", "cohort.canary.acceptance")),
    ("persistence", ("cohort.stable.persistence", "cohort.canary.persistence")),
    ("latency mean (ms)", ("cohort.stable.latency_mean_ms", "cohort.canary.latency_mean_ms")),
    ("edit rate", ("cohort.stable.edit_rate", "cohort.canary.edit_rate")),
    ("canary weight / verdict", ("canary.weight", "judge.verdict")),
)


MLFLOW_USER = "mlflow.user"
"""The run tag MLflow's UI shows as "Created by"."""


class MlflowLedger:
    """:class:`deployer.actions.LedgerPort` on an MLflow tracking server or sqlite URI."""

    def __init__(self, tracking_uri: str, experiment: str = "rtrl-deployments",
                 registered_model: str = "rtrl-policy") -> None:
        self.client = MlflowClient(tracking_uri=tracking_uri)
        self.experiment = experiment
        self.model = registered_model
        """For the links from a ledger run to its model versions."""
        self._exp_id: str | None = None
        self._runs: dict[str, str] = {}

    # ------------------------------------------------------------------ lookup
    def experiment_id(self) -> str:
        if self._exp_id is None:
            self._exp_id = ensure_experiment(self.client, self.experiment, records.LEDGER_EXPERIMENT_NOTE)
        return self._exp_id

    def run_id(self, canary_id: str) -> str | None:
        if canary_id in self._runs:
            return self._runs[canary_id]
        found = self.client.search_runs(
            [self.experiment_id()], filter_string=f"tags.`{TAG_CANARY_ID}` = '{canary_id}'",
            max_results=1,
        )
        if not found:
            return None
        self._runs[canary_id] = found[0].info.run_id
        return self._runs[canary_id]

    def _need(self, canary_id: str) -> str:
        run_id = self.run_id(canary_id)
        if run_id is None:
            raise LookupError(f"no ledger run for canary {canary_id} in experiment {self.experiment}")
        return run_id

    # ------------------------------------------------------------------ the port
    def record(self, event: LedgerEvent) -> None:
        match event:
            case LedgerOpen():
                self._open(event)
            case LedgerStep():
                ts_ms = int(event.ts * 1000)
                metrics = [Metric(k, float(v), ts_ms, event.step) for k, v in event.metrics.items()]
                self.client.log_batch(self._need(event.canary_id), metrics=metrics)
                if event.canary_id.startswith(holdout.ID_PREFIX):  # its description shows the latest effect
                    self._describe(self._need(event.canary_id))
            case LedgerNote():
                self.client.set_tag(self._need(event.canary_id), event.key, ledger.clip(event.text))
            case LedgerClose():
                self._close(event)
            case LedgerRefusal():
                self._refusal(event)

    def _open(self, event: LedgerOpen) -> None:
        if self.run_id(event.canary_id) is not None:
            return
        tags = {**event.tags, "mlflow.runName": event.canary_id}
        run = self.client.create_run(
            self.experiment_id(), start_time=int(event.ts * 1000), tags=tags, run_name=event.canary_id
        )
        self._runs[event.canary_id] = run.info.run_id
        self.client.log_batch(run.info.run_id, params=[Param(k, v) for k, v in event.params.items()])
        self._describe(run.info.run_id)

    def _refusal(self, event: LedgerRefusal) -> None:
        """A finished run of its own: refusals show in ``rtrl history`` beside the canaries."""
        if self.run_id(event.canary_id) is not None:
            return
        ts_ms = int(event.ts * 1000)
        tags = {**event.tags, "mlflow.runName": event.canary_id}
        run = self.client.create_run(self.experiment_id(), start_time=ts_ms, tags=tags,
                                     run_name=event.canary_id)
        self._runs[event.canary_id] = run.info.run_id
        self.client.set_terminated(run.info.run_id, status="FINISHED", end_time=ts_ms)

    def _close(self, event: LedgerClose) -> None:
        run_id = self._need(event.canary_id)
        self.client.log_batch(run_id, tags=[RunTag(k, ledger.clip(v)) for k, v in event.tags.items()])
        self.client.log_text(run_id, json.dumps(event.summary, indent=2, default=str), SUMMARY_ARTIFACT)
        rows = self._describe(run_id)
        self.client.log_text(run_id, records.comparison_csv(rows), COMPARISON_ARTIFACT)
        fig = self._plot(run_id, event)
        try:
            self.client.log_figure(run_id, fig, PLOT_ARTIFACT, save_kwargs={"dpi": 80})
        finally:
            import matplotlib.pyplot as plt

            plt.close(fig)
        decided = self.client.get_run(run_id).data.tags
        self.client.log_batch(run_id, tags=[  # the run list names the outcome; "Created by" the decider
            RunTag("mlflow.runName", records.run_title(decided)),
            RunTag(MLFLOW_USER, decided.get(ledger.TAG_DECIDED_BY, ledger.CONTROLLER))])
        self.client.set_terminated(run_id, status="FINISHED", end_time=int(event.ts * 1000))

    def _describe(self, run_id: str) -> list[records.Row]:
        """Write the run's description (deployer/records.py) from its tags and latest metrics;
        returns the comparison rows it was made from."""
        data = self.client.get_run(run_id).data
        if data.tags.get(TAG_KIND) == holdout.KIND:
            text = holdout.description(data.tags, data.metrics)
            self.client.set_tag(run_id, NOTE, ledger.clip(text))
            return []
        rows = records.comparison(data.metrics)
        text = records.run_description(data.tags, rows, self.model,
                                       self._run_link(data.tags.get("rtrl.candidate.run_id")))
        self.client.set_tag(run_id, NOTE, ledger.clip(text))
        return rows

    def _run_link(self, run_id: str | None) -> str | None:
        if not run_id:
            return None
        try:
            return records.run_link(self.client.get_run(run_id).info.experiment_id, run_id)
        except MlflowException:  # the training run was deleted: no link
            return None

    # ------------------------------------------------------------------ plot
    def series(self, run_id: str, key: str) -> list[tuple[int, float]]:
        return sorted((m.step, m.value) for m in self.client.get_metric_history(run_id, key))

    def _plot(self, run_id: str, event: LedgerClose) -> Any:
        """A figure of both cohorts' metrics and the canary weight over the judged ticks."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        is_holdout = event.tags.get(TAG_KIND) == holdout.KIND
        panels = holdout.PANELS if is_holdout else PANELS
        fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.2 * len(panels)), sharex=True)
        for ax, (title, keys) in zip(axes, panels, strict=True):
            for key in keys:
                points = self.series(run_id, key)
                if points:
                    ax.plot([p[0] for p in points], [p[1] for p in points], marker=".", label=key)
            ax.set_title(title, fontsize=9)
            if ax.lines:
                ax.legend(fontsize=7, loc="best")
        decision = event.tags.get(ledger.TAG_DECISION, "ended" if is_holdout else "?")
        by = event.tags.get(ledger.TAG_DECIDED_BY, "?")
        fig.suptitle(f"{event.canary_id}: {decision} (decided by {by})", fontsize=10)
        axes[-1].set_xlabel("measured at (Unix seconds)" if is_holdout else "judged tick")
        fig.tight_layout()
        return fig

    # ------------------------------------------------------------------ reading
    def history(self, limit: int = 20) -> list[dict[str, Any]]:
        """The latest ledger runs, newest first, as plain dicts for ``rtrl history``."""
        runs = self.client.search_runs(
            [self.experiment_id()], order_by=["attributes.start_time DESC"], max_results=limit
        )
        return [_row(r.info, r.data.tags, r.data.params) for r in runs]

    def decision(self, run_id: str) -> dict[str, Any] | None:
        """The run's ``decision.json`` (deployer/ledger.py's ``summary``); None when the run has
        none (still running, not a canary) or it is not a JSON object."""
        with tempfile.TemporaryDirectory() as tmp:
            try:
                path = self.client.download_artifacts(run_id, SUMMARY_ARTIFACT, tmp)
            except (MlflowException, OSError):
                return None
            try:
                doc = json.loads(Path(path).read_text())
            except (ValueError, OSError):
                return None
        return doc if isinstance(doc, dict) else None


def _row(info: Any, tags: Mapping[str, str], params: Mapping[str, str]) -> dict[str, Any]:
    return {
        "run_id": info.run_id,
        "canary_id": tags.get(TAG_CANARY_ID, info.run_name),
        "kind": tags.get(TAG_KIND, ""),
        "candidate": params.get("candidate_version", tags.get(TAG_CANDIDATE, "")),
        "stable": params.get("stable_version", tags.get(TAG_STABLE, "")),
        "outcome": tags.get(ledger.TAG_OUTCOME, ""),
        "decision": tags.get(ledger.TAG_DECISION, ""),
        "reason": tags.get(ledger.TAG_REASON, ""),
        "decided_by": tags.get(ledger.TAG_DECIDED_BY, ""),
        "decided_at": tags.get(TAG_DECIDED_AT, ""),
        "started_ms": info.start_time,
    }
