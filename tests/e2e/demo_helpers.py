"""What the e2e tests of ``rtrl demo`` share: running it as a user would, and checking that
nothing it started outlived it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from services.stack.embedded import pid_alive

REPO = Path(__file__).resolve().parents[2]


LOOP_TIMEOUT_S = 1650
"""pytest's timeout for whichever test sets the shared ``loop_run`` up (it pays for the run)."""

NO_HOLDOUT_MEASURE = {"RTRL_DEMO__HOLDOUT_MEASURE_S": "0"}
"""The demo serves ``holdout_measure_s`` (60 s) more once its canaries are decided, so its
report can compare the last champion with the holdout; no e2e test asserts on that
comparison (tests/integration/test_holdout_live.py and the unit tier do), so the bounded
runs skip that minute. The holdout itself (15% of the users) still runs."""


def demo_env(demo: Mapping[str, str]) -> dict[str, str]:
    """This process's environment without any RTRL_* setting but the demo's own (the demo
    configures its own stack), plus ``demo``'s RTRL_DEMO__* settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RTRL_") or k.startswith("RTRL_DEMO__")}
    return {**env, **demo}


def run_demo(args: list[str], data: Path, reports: Path, env: Mapping[str, str],
             timeout_s: float) -> tuple[subprocess.CompletedProcess[str], str]:
    """``rtrl demo ARGS --data-dir --report-dir --keep-stack`` in a subprocess from the
    repository; (the process, its stdout and stderr)."""
    argv = [sys.executable, "-m", "services.cli", "demo", *args, "--data-dir", str(data),
            "--report-dir", str(reports), "--keep-stack"]
    proc = subprocess.run(argv, cwd=REPO, env=dict(env), capture_output=True, text=True, timeout=timeout_s)
    return proc, proc.stdout + proc.stderr


def leftovers(data: Path) -> dict[str, int]:
    """Processes the demo recorded that are still running (none should be)."""
    pids = json.loads((data / "pids.json").read_text()) if (data / "pids.json").exists() else {}
    return {n: pid for n, pid in pids.items() if pid_alive(pid)}


STORY = (" rtrl.trainer: increment: ", " rtrl.trainer: cadence: start", "trainer.increment: increment ",
         " rtrl.deployer: canary ")


def story(data: Path, width: int = 260) -> str:
    """The loop's decisive log lines (increments started and finished, canary transitions), in
    time order: what a failure message needs first."""
    lines: list[str] = []
    for name in ("trainer.log", "deployer.log"):
        path = data / "logs" / name
        if path.exists():
            text = path.read_text(errors="replace").splitlines()
            lines += [ln[:width] for ln in text if any(mark in ln for mark in STORY)]
    return "the loop's story:\n" + "\n".join(sorted(lines))


@dataclass
class LedgerRun:
    """One ledger run in the demo's MLflow, as the closed-loop test checks it."""

    tags: dict[str, str]
    status: str
    weight_history: int
    """Points in the run's ``canary.weight`` history."""
    metrics: list[str]


@dataclass
class Ledger:
    """The demo's ledger and registry, read before its stack was stopped."""

    experiment_found: bool
    runs: dict[str | None, LedgerRun]
    """By the run's ``rtrl.candidate_version`` tag (a later run of a version replaces an earlier)."""
    version_tags: dict[str, dict[str, str]]
    """Tags of every version of ``rtrl-policy``."""
    champion: str | None


@dataclass
class LoopRun:
    """What one ``rtrl demo`` run left for its tests (tests/e2e/conftest.py: ``loop_run``)."""

    data: Path
    reports: Path
    every: float
    """Seconds between chaos kills."""
    proc: subprocess.CompletedProcess[str]
    out: str
    """Its stdout and stderr."""
    leftovers: dict[str, int]
    """Processes it recorded that still ran right after it exited."""
    ledger: Ledger | None
    ledger_error: str


def read_ledger(mlflow_uri: str, experiment: str = "rtrl-deployments",
                model: str = "rtrl-policy") -> tuple[Ledger | None, str]:
    """The ledger runs, the versions' tags and the champion in the demo's MLflow; (None, why)
    when MLflow cannot be read, so the tests fail with the reason rather than the fixture."""
    from mlflow import MlflowClient

    try:
        client = MlflowClient(tracking_uri=mlflow_uri)
        exp = client.get_experiment_by_name(experiment)
        runs: dict[str | None, LedgerRun] = {}
        if exp is not None:
            for r in client.search_runs([exp.experiment_id]):
                runs[r.data.tags.get("rtrl.candidate_version")] = LedgerRun(
                    tags=dict(r.data.tags), status=r.info.status,
                    weight_history=len(client.get_metric_history(r.info.run_id, "canary.weight")),
                    metrics=sorted(r.data.metrics))
        versions = {str(v.version): dict(v.tags) for v in client.search_model_versions(f"name='{model}'")}
        try:
            champion: str | None = str(client.get_model_version_by_alias(model, "champion").version)
        except Exception:
            champion = None
        return Ledger(exp is not None, runs, versions, champion), ""
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"
