"""The shipped alert rules against the real services, scraped by a real Prometheus.

Every service runs as its own process on the session's broker, Redis and MLflow, simulated
users send traffic through the gateway, and Debian's ``prometheus`` scrapes each process
with the target labels prometheus-operator gives the chart's ServiceMonitor targets and
evaluates the rule files of ``helm/rtrl/files/alerts/``. Only durations are shortened
(``for:`` of the down rules and the lag rule, and the lag threshold), so the test takes
minutes, not hours; tests/reliability/test_outage_alerts.py runs the rules unchanged against
broker and Redis outages. Checked:

- in normal operation no alert is pending or firing;
- every metric an alert or a dashboard panel uses is exported by some live target;
- a manual command the deployer refuses fires ``RtrlOperatorCommandRefused``;
- killing each service (SIGKILL) fires its alert: the reward worker also fires the
  broker-side lag alert, which its own (vanished) series could not.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.runtime.kafka_io import ensure_topics
from services.settings.model import Settings
from services.stack.embedded import free_port
from services.stack.supervisor import ProcSpec, Supervisor, serve_argv
from tests.live_alerts import (
    Prometheus,
    all_up,
    live_env,
    operator_targets,
    prometheus_binary,
    ready,
    register_champion,
    served,
    wait,
)

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "helm"))
import chart_tools as ct  # noqa: E402
import dashboard  # noqa: E402

SERVICES = ("ingest", "reward", "trainer", "deployer", "gateway", "simulator")
SHORTER = {"services.yaml": [("for: 3m", "for: 5s"), ("for: 5m", "for: 5s")],
           "pipeline.yaml": [("(rtrl_group_lag_seconds) > 900\n        for: 10m",
                              "(rtrl_group_lag_seconds) > 15\n        for: 5s")]}
"""Text replacements that only shorten durations, per rule file."""


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


@pytest.fixture
def prometheus() -> str:
    return prometheus_binary()


@pytest.mark.timeout(900)
def test_alerts_stay_quiet_in_operation_and_fire_for_each_killed_service(
        settings: Settings, mlflow_server: str, tmp_path: Path, prometheus: str) -> None:
    gateway_port, prom_port = free_port(), free_port()
    env = live_env(settings, mlflow_server, tmp_path, gateway_port,
                   RTRL_DEPLOYER__TICK_S="2", RTRL_DEPLOYER__LAG_INTERVAL_S="2")
    register_champion(env, tmp_path)
    ensure_topics(settings)

    ports = {name: (gateway_port if name == "gateway" else free_port()) for name in SERVICES}
    (tmp_path / "rules").mkdir()
    rules = _rules(tmp_path / "rules")
    prom_proc = Prometheus(prometheus, tmp_path, prom_port, operator_targets(ports), rules)
    prom = prom_proc.api
    sup = Supervisor(tmp_path / "logs", env)
    try:
        for name in SERVICES:
            spec_env = {"RTRL_HTTP__PORT": str(ports[name])}
            if name == "simulator":
                wait(lambda: ready(gateway_port), 120, "the gateway never became ready", sup)
            sup.start(ProcSpec(name, serve_argv(name), spec_env))
        wait(lambda: all_up(prom, len(SERVICES)), 180, "not every service is scraped", sup)
        wait(lambda: served(prom) > 200, 180, "the users' requests are not served", sup)
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
        wait(lambda: prom.firing("RtrlOperatorCommandRefused", command="pause"), 60,
             f"RtrlOperatorCommandRefused did not fire for a refused pause: {cli.stdout}{cli.stderr}", sup)

        kills = [("reward", "RtrlWorkerDown"), ("ingest", "RtrlWorkerDown"), ("trainer", "RtrlWorkerDown"),
                 ("gateway", "RtrlServiceDown"), ("deployer", "RtrlServiceDown")]
        for name, alert in kills:
            os.killpg(sup.procs[name].pid, signal.SIGKILL)
            wait(lambda: prom.firing(alert, app_kubernetes_io_component=name), 90,  # noqa: B023
                 f"{alert} did not fire for the killed {name}", sup)
            if name == "reward":
                wait(lambda: prom.firing("RtrlPipelineLagHigh", group=env["RTRL_REWARD__GROUP_ID"]), 90,
                     "the broker-side lag alert did not fire for the dead reward group", sup)
    finally:
        sup.stop_all(grace_s=10)
        prom_proc.stop()


def ct_exprs() -> list[tuple[str, str]]:
    board = json.loads(ct.DASHBOARD.read_text())
    return ([(r["alert"], r["expr"]) for r in ct.alert_rules()]
            + [(f"panel {i}", e) for i, e in enumerate(dashboard.expressions(board))])


def _family(name: str) -> str:
    for suffix in ("_bucket", "_count", "_sum"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name
