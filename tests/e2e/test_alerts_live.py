"""The shipped alert rules against the real services, scraped by a real Prometheus.

Every service runs as its own process on the session's broker, Redis and MLflow, simulated
users send traffic through the gateway, and Debian's ``prometheus`` scrapes each process
with the target labels the chart's ServiceMonitor adds and evaluates the rule files of
``helm/rtrl/files/alerts/``. Only durations are shortened (``for:`` of the down rules and
the lag rule, and the lag threshold), so the test takes minutes, not hours. Checked:

- in normal operation no alert is pending or firing;
- every metric an alert or a dashboard panel uses is exported by some live target;
- a manual command the deployer refuses fires ``RtrlOperatorCommandRefused``;
- killing each service (SIGKILL) fires its alert: the reward worker also fires the
  broker-side lag alert, which its own (vanished) series could not.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from deployer.adapters.mlflow_registry import MlflowRegistry
from services.runtime.kafka_io import ensure_topics
from services.settings.model import Settings
from services.stack.embedded import free_port
from services.stack.supervisor import ProcSpec, Supervisor, serve_argv
from trainer.policy import TinyConfig, TinyTransformer

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "helm"))
import chart_tools as ct  # noqa: E402
import dashboard  # noqa: E402

SERVICES = ("ingest", "reward", "trainer", "deployer", "gateway", "simulator")
SHORTER = {"services.yaml": [("for: 3m", "for: 5s"), ("for: 5m", "for: 5s")],
           "pipeline.yaml": [("(rtrl_group_lag_seconds) > 900\n        for: 10m",
                              "(rtrl_group_lag_seconds) > 15\n        for: 5s")]}
"""Text replacements that only shorten durations, per rule file."""


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:  # noqa: S310 - http to the test's Prometheus
        return json.loads(resp.read())


class Prom:
    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}/api/v1"

    def alerts(self) -> list[dict[str, Any]]:
        return list(_get(f"{self.base}/alerts")["data"]["alerts"])

    def firing(self, name: str, **labels: str) -> bool:
        return any(a["labels"].get("alertname") == name and a["state"] == "firing"
                   and all(a["labels"].get(k) == v for k, v in labels.items()) for a in self.alerts())

    def query(self, expr: str) -> list[dict[str, Any]]:
        return list(_get(f"{self.base}/query?query={urllib.parse.quote(expr)}")["data"]["result"])

    def names(self) -> set[str]:
        series = set(_get(f"{self.base}/label/__name__/values")["data"])
        families = {m["metric"] for m in _get(f"{self.base}/targets/metadata")["data"]}
        return series | families


def _rules(dest: Path) -> list[str]:
    out = []
    for path in sorted(ct.ALERTS.glob("*.yaml")):
        text = path.read_text()
        for old, new in SHORTER.get(path.name, []):
            assert old in text, f"{path.name}: {old!r} not found (update the test's SHORTER)"
            text = text.replace(old, new)
        (dest / path.name).write_text(text)
        out.append(str(dest / path.name))
    return out


def _env(settings: Settings, mlflow_uri: str, tmp: Path, gateway_port: int) -> dict[str, str]:
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
        "RTRL_DEPLOYER__TICK_S": "2", "RTRL_DEPLOYER__LAG_INTERVAL_S": "2",
        "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
        "MLFLOW_DISABLE_TELEMETRY": "true", "PYTHONUNBUFFERED": "1",
    }


@pytest.fixture
def prometheus() -> str:
    binary = shutil.which("prometheus")
    if binary is None:
        if os.environ.get("CI") == "true":
            pytest.fail("prometheus is missing: scripts/tools installs it (apt-get install prometheus)")
        pytest.skip("prometheus is not installed (scripts/tools installs it)")
    return binary


@pytest.mark.timeout(900)
def test_alerts_stay_quiet_in_operation_and_fire_for_each_killed_service(
        settings: Settings, mlflow_server: str, tmp_path: Path, prometheus: str) -> None:
    gateway_port, prom_port = free_port(), free_port()
    env = _env(settings, mlflow_server, tmp_path, gateway_port)
    reg = MlflowRegistry(mlflow_server, env["RTRL_MLFLOW__REGISTERED_MODEL"],
                         env["RTRL_MLFLOW__TRAINING_EXPERIMENT"])
    small = TinyConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, max_len=64)
    reg.set_alias("champion", reg.register(None, TinyTransformer(small).save(tmp_path / "champion")))
    ensure_topics(settings)

    ports = {name: (gateway_port if name == "gateway" else free_port()) for name in SERVICES}
    targets = [{"targets": [f"127.0.0.1:{port}"], "labels": {
        "namespace": "it", "app_kubernetes_io_name": "rtrl", "app_kubernetes_io_instance": "live",
        "app_kubernetes_io_component": name}} for name, port in ports.items()]
    (tmp_path / "rules").mkdir()
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
              "rule_files": _rules(tmp_path / "rules"),
              "scrape_configs": [{"job_name": "rtrl", "static_configs": targets}]}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    prom_log = open(tmp_path / "prometheus.log", "wb")
    prom_proc = subprocess.Popen(
        [prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{prom_port}", "--storage.tsdb.retention.time=1h"],
        stdout=prom_log, stderr=subprocess.STDOUT, start_new_session=True)
    prom = Prom(prom_port)
    sup = Supervisor(tmp_path / "logs", env)
    try:
        for name in SERVICES:
            spec_env = {"RTRL_HTTP__PORT": str(ports[name])}
            if name == "simulator":
                _wait(lambda: _ready(gateway_port), 120, "the gateway never became ready", sup)
            sup.start(ProcSpec(name, serve_argv(name), spec_env))
        _wait(lambda: _all_up(prom, len(SERVICES)), 180, "not every service is scraped", sup)
        _wait(lambda: _served(prom) > 200, 180, "the users' requests are not served", sup)
        time.sleep(20)  # rate windows fill, lag readings settle

        active = [(a["labels"]["alertname"], a["state"], a["labels"]) for a in prom.alerts()]
        assert not active, f"alerts active in normal operation: {active}"

        exported = prom.names() | {"up"}
        used = {n for _, e in ct_exprs() for n in ct.metric_names(e)}
        missing = {n for n in used if n not in exported and _family(n) not in exported}
        assert not missing, f"used by alerts or panels but exported by no live target: {sorted(missing)}"

        # a manual command the deployer refuses (unsigned; this deployer has no operator keys)
        cli = subprocess.run([sys.executable, "-m", "services.cli", "pause", "--reason", "alert check",
                              "--timeout", "5"], env=env, capture_output=True, text=True, timeout=60)
        _wait(lambda: prom.firing("RtrlOperatorCommandRefused", command="pause"), 60,
              f"RtrlOperatorCommandRefused did not fire for a refused pause: {cli.stdout}{cli.stderr}", sup)

        kills = [("reward", "RtrlWorkerDown"), ("ingest", "RtrlWorkerDown"), ("trainer", "RtrlWorkerDown"),
                 ("gateway", "RtrlServiceDown"), ("deployer", "RtrlServiceDown")]
        for name, alert in kills:
            os.killpg(sup.procs[name].pid, signal.SIGKILL)
            _wait(lambda: prom.firing(alert, app_kubernetes_io_component=name), 90,  # noqa: B023
                  f"{alert} did not fire for the killed {name}", sup)
            if name == "reward":
                _wait(lambda: prom.firing("RtrlPipelineLagHigh", group=env["RTRL_REWARD__GROUP_ID"]), 90,
                      "the broker-side lag alert did not fire for the dead reward group", sup)
    finally:
        sup.stop_all(grace_s=10)
        prom_proc.terminate()
        try:
            prom_proc.wait(20)
        except subprocess.TimeoutExpired:
            prom_proc.kill()
        prom_log.close()


def ct_exprs() -> list[tuple[str, str]]:
    board = json.loads(ct.DASHBOARD.read_text())
    return ([(r["alert"], r["expr"]) for r in ct.alert_rules()]
            + [(f"panel {i}", e) for i, e in enumerate(dashboard.expressions(board))])


def _family(name: str) -> str:
    for suffix in ("_bucket", "_count", "_sum"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def _all_up(prom: Prom, n: int) -> bool:
    up = prom.query('up{app_kubernetes_io_name="rtrl"} == 1')
    return len(up) == n


def _served(prom: Prom) -> float:
    got = prom.query('sum(rtrl_gateway_exposures_total{result="sent"})')
    return float(got[0]["value"][1]) if got else 0.0


def _wait(check: Any, timeout_s: float, what: str, sup: Supervisor) -> None:
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

