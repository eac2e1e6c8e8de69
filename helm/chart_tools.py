"""Helpers the chart tests share: find helm and promtool, render the chart, load alerts.

The tools come from scripts/tools (helm under .tools/bin, promtool from Debian's
prometheus package). In CI (CI=true) a missing tool fails the test; elsewhere it skips
with the command that installs it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
HELM_DIR = ROOT / "helm"
CHART = HELM_DIR / "rtrl"
ALERTS = CHART / "files" / "alerts"
DASHBOARD = CHART / "files" / "dashboards" / "rtrl.json"
ALERT_TESTS = HELM_DIR / "tests" / "alerts"
RUNBOOKS = ROOT / "docs" / "runbooks"
DEFAULT_RUNBOOK_BASE = "https://github.com/rtrl/rtrl/blob/main/docs/runbooks"

# Every values file the chart is checked with; "everything" turns on each optional part.
REQUIRED: list[str] = ["--set", "gateway.apiKeys.app=s3cret-api-key",
                       "--set", "auth.keys.gateway=s3cret-auth"]
"""What a bare install must be given (the chart fails without it, saying so): client API keys
and the gateway's signing key."""

VALUES_SETS: dict[str, list[str]] = {
    "default": REQUIRED,
    "vllm": [*REQUIRED, "-f", str(HELM_DIR / "examples" / "vllm-gpu.yaml")],
    "strimzi": ["-f", str(HELM_DIR / "examples" / "strimzi.yaml")],
    "small": ["-f", str(HELM_DIR / "examples" / "small.yaml")],
    "extension-points": ["-f", str(HELM_DIR / "examples" / "extension-points.yaml")],
    "everything": [
        "--set", "serviceMonitor.enabled=true",
        "--set", "prometheusRule.enabled=true",
        "--set", "dashboards.enabled=true",
        "--set", "ray.cluster.enabled=true",
        "--set", "ingest.autoscaling.enabled=true",
        "--set", "reward.autoscaling.enabled=true",
        "--set", "trainer.persistence.enabled=true",
        "--set", "kafka.securityProtocol=SASL_SSL",
        "--set", "kafka.sasl.mechanism=SCRAM-SHA-512",
        "--set", "kafka.sasl.username=rtrl",
        "--set", "kafka.sasl.password=s3cret-sasl",
        "--set", "kafka.tls.caSecret.name=events-cluster-ca-cert",
        "--set", "kafka.tls.clientSecret.name=rtrl-user",
        "--set", "auth.keys.gateway=s3cret-auth",
        "--set", "gateway.apiKeys.app=s3cret-api-key",
        "--set", "engine.kind=vllm",
        "--set", "engine.baseUrl=http://vllm.serving:8000",
        "--set", "engine.apiKey=s3cret-engine",
        "--set", "engine.adapters.create=true",
        "--set", "trainer.resources.limits.nvidia\\.com/gpu=1",
        "--set", "ray.cluster.workers.resources.limits.nvidia\\.com/gpu=1",
        "--set", "ray.cluster.workers.runtimeClassName=nvidia",
        "--set", "ray.numWorkers=2", "--set", "ray.cpusPerWorker=2", "--set", "ray.useGpu=true",
        "--set", "mlflow.envFromSecret=rtrl-mlflow",
        "--set", "imagePullSecrets[0].name=regcred",
        "--set", "deployer.notifications.urls[0]=https://hooks.example/s3cret-hook",
        "--set", "deployer.notifications.format=slack",
        "--set", "deployer.notifications.hmacKey=s3cret-hmac",
        "--set", "deployer.notifications.mlflowUiUrl=https://mlflow.example.com",
    ],
}


def tool(name: str) -> str:
    """Path of helm or promtool; fails in CI and skips elsewhere when it is missing."""
    path = shutil.which(name, path=f"{ROOT / '.tools' / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    if path:
        return path
    message = f"{name} not found: run scripts/tools (installs helm under .tools/bin and promtool)"
    if os.environ.get("CI", "").lower() in {"1", "true", "yes"}:
        pytest.fail(message)
    pytest.skip(message)


def helm_env(home: Path) -> dict[str, str]:
    """Environment that keeps helm's cache, config and data out of the user's home."""
    env = dict(os.environ)
    for var in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
        env[var] = str(home / var.lower())
    return env


def run(argv: Sequence[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, env=env, timeout=120, check=False)


def helm_template(helm: str, env: dict[str, str], args: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return run([helm, "template", "rel", str(CHART), "--namespace", "rtrl", *args], env=env)


def documents(rendered: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(rendered) if d]


def alert_groups() -> dict[Path, list[dict[str, Any]]]:
    """Rule groups of every alert file, by file."""
    return {path: yaml.safe_load(path.read_text())["groups"] for path in sorted(ALERTS.glob("*.yaml"))}


def alert_rules() -> list[dict[str, Any]]:
    groups = [g for file_groups in alert_groups().values() for g in file_groups]
    return [rule for g in groups for rule in g["rules"] if "alert" in rule]


_PROMQL_KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
                    "bool", "offset", "inf", "nan", "atan2"}


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (functions, keywords, labels and durations removed)."""
    text = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)  # string literals
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges and subqueries
    names = set()
    for match in re.finditer(r"(?<![\w.$])[A-Za-z_:][\w:]*", text):
        rest = text[match.end():]
        if re.match(r"\s*\(", rest) or match.group() in _PROMQL_KEYWORDS:
            continue  # a function call or an operator keyword
        names.add(match.group())
    return names
