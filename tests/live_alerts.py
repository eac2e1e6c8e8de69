"""What the live alert tests share (tests/e2e/test_alerts_live.py,
tests/reliability/test_outage_alerts.py): every rtrl service as its own process, Debian's
``prometheus`` scraping each with the target labels prometheus-operator gives a
ServiceMonitor's targets, and its HTTP API."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from deployer.adapters.mlflow_registry import MlflowRegistry
from services.report.cohorts import parse_ts
from services.settings.model import Settings
from services.stack.supervisor import Supervisor
from trainer.policy import TinyConfig, TinyTransformer

ALERTS = Path(__file__).resolve().parents[1] / "helm" / "rtrl" / "files" / "alerts"
"""The rule files the chart ships (helm/chart_tools.py's ALERTS)."""
NAMESPACE = "it"
RELEASE = "live"


def shipped_rules() -> list[str]:
    """The chart's alert rule files, as they are."""
    return [str(p) for p in sorted(ALERTS.glob("*.yaml"))]


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:  # noqa: S310 - http to the test's Prometheus
        return json.loads(resp.read())


class Prom:
    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}/api/v1"

    def alerts(self) -> list[dict[str, Any]]:
        """Every alert pending or firing now."""
        return list(_get(f"{self.base}/alerts")["data"]["alerts"])

    def firing(self, name: str, **labels: str) -> bool:
        return any(a["labels"].get("alertname") == name and a["state"] == "firing"
                   and all(a["labels"].get(k) == v for k, v in labels.items()) for a in self.alerts())

    def query(self, expr: str) -> list[dict[str, Any]]:
        return list(_get(f"{self.base}/query?query={urllib.parse.quote(expr)}")["data"]["result"])

    def value(self, expr: str) -> float:
        """The first sample of an instant query (0 when it has none)."""
        got = self.query(expr)
        return float(got[0]["value"][1]) if got else 0.0

    def targets(self) -> dict[str, str]:
        """Each component's last scrape as Prometheus saw it: health, duration and error."""
        out = {}
        for t in _get(f"{self.base}/targets")["data"]["activeTargets"]:
            seen = f'{t["health"]} in {t["lastScrapeDuration"]:.3f} s at {t["lastScrape"]} {t["lastError"]}'
            out[t["labels"].get("app_kubernetes_io_component", t["scrapeUrl"])] = seen.rstrip()
        return out

    def evaluated_after(self, wall: float) -> bool:
        """Whether every rule group has been evaluated since ``wall`` (a ``time.time()``): an
        alert made pending by a scrape that failed before then is resolved or still pending
        on its own merits by now, not left over from a target that was still starting."""
        groups = _get(f"{self.base}/rules")["data"]["groups"]
        return bool(groups) and all(parse_ts(g["lastEvaluation"]) > wall for g in groups)

    def names(self) -> set[str]:
        series = set(_get(f"{self.base}/label/__name__/values")["data"])
        families = {m["metric"] for m in _get(f"{self.base}/targets/metadata")["data"]}
        return series | families


def prometheus_binary() -> str:
    """Debian's prometheus: a failure in CI (scripts/tools installs it), a skip elsewhere."""
    binary = shutil.which("prometheus")
    if binary is None:
        if os.environ.get("CI") == "true":
            pytest.fail("prometheus is missing: scripts/tools installs it (apt-get install prometheus)")
        pytest.skip("prometheus is not installed (scripts/tools installs it)")
    return binary


def operator_targets(ports: Mapping[str, int]) -> list[dict[str, Any]]:
    """One static target per component with the labels prometheus-operator gives the targets of
    the chart's ServiceMonitor (release ``live`` in namespace ``it``): ``job`` and ``service``
    are the Kubernetes Service's name, ``pod``, ``container`` (the component) and ``endpoint``
    (the port's name), and the ServiceMonitor's targetLabels."""
    out = []
    for component, port in ports.items():
        svc = f"{RELEASE}-rtrl-{component}"
        out.append({"targets": [f"127.0.0.1:{port}"], "labels": {
            "job": svc, "namespace": NAMESPACE, "service": svc, "pod": f"{svc}-7d9c5b6f4-x{port}",
            "container": component, "endpoint": "metrics",
            "app_kubernetes_io_name": "rtrl", "app_kubernetes_io_instance": RELEASE,
            "app_kubernetes_io_component": component}})
    return out


class Prometheus:
    """Debian's prometheus on a free port, scraping ``targets`` and evaluating ``rule_files``."""

    def __init__(self, binary: str, tmp: Path, port: int, targets: list[dict[str, Any]],
                 rule_files: Iterable[str], interval: str = "1s") -> None:
        timeout = "900ms" if interval == "1s" else "10s"
        config = {"global": {"scrape_interval": interval, "evaluation_interval": interval,
                             "scrape_timeout": timeout},
                  "rule_files": list(rule_files),
                  "scrape_configs": [{"job_name": "rtrl", "static_configs": targets}]}
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = open(tmp / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=2h"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.api = Prom(port)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def live_env(settings: Settings, mlflow_uri: str, tmp: Path, gateway_port: int,
             **extra: str) -> dict[str, str]:
    """The environment of every ``rtrl serve`` process on ``settings``' broker and Redis;
    ``extra`` comes last and wins."""
    tag = settings.redis.key_prefix.rstrip(":")
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("RTRL_")},
        "RTRL_STACK__DATA_DIR": str(tmp / "nostack"),
        "RTRL_KAFKA__BOOTSTRAP_SERVERS": settings.kafka.bootstrap_servers,
        "RTRL_REDIS__URL": settings.redis.url.get_secret_value(),
        "RTRL_REDIS__KEY_PREFIX": settings.redis.key_prefix,
        "RTRL_TOPICS__RAW": settings.topics.raw, "RTRL_TOPICS__EVENTS": settings.topics.events,
        "RTRL_TOPICS__REWARDS": settings.topics.rewards, "RTRL_TOPICS__DLQ": settings.topics.dlq,
        "RTRL_INGEST__GROUP_ID": f"{tag}-ingest", "RTRL_REWARD__GROUP_ID": f"{tag}-reward",
        "RTRL_MLFLOW__TRACKING_URI": mlflow_uri,
        "RTRL_MLFLOW__REGISTERED_MODEL": f"{tag}-policy",
        "RTRL_MLFLOW__TRAINING_EXPERIMENT": f"{tag}-training",
        "RTRL_MLFLOW__DEPLOYMENTS_EXPERIMENT": f"{tag}-deployments",
        "RTRL_AUTH__KEYS": json.dumps({"gateway": "gw-signing", "simulator": "sim-signing"}),
        "RTRL_GATEWAY__PORT": str(gateway_port),
        "RTRL_GATEWAY__API_KEYS": json.dumps({"simulator": "sim-api-key"}),
        "RTRL_GATEWAY__MODEL_CACHE_DIR": str(tmp / "gateway-cache"),
        "RTRL_SIMULATOR__API_KEY": "sim-api-key",
        "RTRL_SIMULATOR__GATEWAY_URL": f"http://127.0.0.1:{gateway_port}",
        "RTRL_SIMULATOR__RATE_PER_S": "15", "RTRL_SIMULATOR__MAX_TOKENS": "8",
        "RTRL_TRAINER__INTERVAL_S": "3600", "RTRL_TRAINER__DATA_DIR": str(tmp / "trainer"),
        "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
        "MLFLOW_DISABLE_TELEMETRY": "true", "PYTHONUNBUFFERED": "1",
        **extra,
    }


def register_champion(env: Mapping[str, str], tmp: Path) -> None:
    """A tiny policy registered in ``env``'s MLflow with the ``champion`` alias, for the gateway."""
    reg = MlflowRegistry(env["RTRL_MLFLOW__TRACKING_URI"], env["RTRL_MLFLOW__REGISTERED_MODEL"],
                         env["RTRL_MLFLOW__TRAINING_EXPERIMENT"])
    small = TinyConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, max_len=64)
    reg.set_alias("champion", reg.register(None, TinyTransformer(small).save(tmp / "champion")))


def ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def all_up(prom: Prom, n: int) -> bool:
    return len(prom.query('up{app_kubernetes_io_name="rtrl"} == 1')) == n


def served(prom: Prom) -> float:
    return prom.value('sum(rtrl_gateway_exposures_total{result="sent"})')


def wait(check: Callable[[], Any], timeout_s: float, what: str, sup: Supervisor) -> None:
    """Until ``check()`` is true (an OSError counts as false); else fail with each log's tail."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(1)
    logs = "\n".join(f"--- {n}\n{sup.log_tail(n, 20)}" for n in sup.procs)
    raise AssertionError(f"{what} within {timeout_s:.0f}s\n{logs}")
