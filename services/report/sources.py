"""Where the demo report's evidence comes from: the reward records on the rewards topic and
the deployer's decision ledger in MLflow (one run per canary)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from deployer.records import run_link
from services.runtime.kafka_io import read_topic
from services.settings.model import Settings


@dataclass(frozen=True)
class Decision:
    """One canary from the ledger (the deployments experiment in MLflow)."""

    canary_id: str
    candidate: str
    stable: str
    outcome: str
    reason: str
    decided_by: str
    decided_at: str
    started_at: float
    kind: str = ""
    """What the candidate version was (rtrl.kind tag): increment, bootstrap, or an injected one."""
    url: str = ""
    evidence: dict[str, float] = field(default_factory=dict)
    """Last value of each cohort.* and judge.* metric."""


def read_rewards(settings: Settings) -> list[dict[str, Any]]:
    """Every reward record on the rewards topic, from the beginning (read_committed); records
    that are not JSON are skipped."""
    out: list[dict[str, Any]] = []
    for rec in read_topic(settings.kafka, settings.topics.rewards):
        try:
            doc = json.loads(rec.value)
        except (TypeError, ValueError, RecursionError):
            continue
        if isinstance(doc, dict):
            out.append(doc)
    return out


def read_ledger(tracking_uri: str, experiment: str) -> list[Decision]:
    """The decided canaries of the deployments experiment, oldest first."""
    from mlflow import MlflowClient  # slow to import: only when the ledger is read

    client = MlflowClient(tracking_uri=tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    out = []
    runs = client.search_runs([exp.experiment_id], max_results=500,
                              order_by=["attributes.start_time ASC"])
    for run in runs:
        tags = run.data.tags
        outcome = tags.get("rtrl.canary.outcome", "")
        if outcome in {"", "running"} or tags.get("rtrl.canary.kind") == "holdout":
            continue  # undecided, or the long-term holdout's run (report_holdout.py measures it)
        out.append(Decision(
            canary_id=tags.get("rtrl.canary.id", run.info.run_name or run.info.run_id),
            candidate=tags.get("rtrl.candidate_version", ""),
            stable=tags.get("rtrl.stable_version", ""),
            outcome=outcome,
            reason=tags.get("rtrl.decision.reason", ""),
            decided_by=tags.get("rtrl.decided_by", ""),
            decided_at=tags.get("rtrl.decided_at", ""),
            started_at=run.info.start_time / 1000.0,
            url=f"{tracking_uri.rstrip('/')}/{run_link(exp.experiment_id, run.info.run_id)}"
            if tracking_uri.startswith("http") else "",
            evidence={k: float(v) for k, v in run.data.metrics.items()},
        ))
    return out
