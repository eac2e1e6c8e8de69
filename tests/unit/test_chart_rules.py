"""Alerts and dashboard: promtool checks and unit-tests the alert files exactly as the
chart ships them, every alert carries severity, summary, description and a runbook that
exists, and every dashboard expression parses."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "helm"))
import chart_tools as ct
import dashboard
from chart_docs import Render, by_kind

REQUIRED_ALERTS = {
    "RtrlPipelineLagHigh",
    "RtrlServiceDown",
    "RtrlWorkerDown",
    "RtrlExposuresLost",
    "RtrlRollbackFailing",
    "RtrlGatewayErrorBudgetBurn",
    "RtrlGatewayErrorBudgetSlowBurn",
    "RtrlGatewayLatencyBudgetBurn",
    "RtrlGatewayLatencyBudgetSlowBurn",
    "RtrlRewardWindowsNotClosing",
    "RtrlDeadLetterRateSpike",
    "RtrlTrainingIncrementFailed",
    "RtrlTrainingOverdue",
    "RtrlCanaryRolledBack",
    "RtrlCanaryInconclusive",
    "RtrlCanaryStuck",
    "RtrlRewardHackingDetected",
    "RtrlDependencyUnavailable",
    "RtrlDependencyOutage",
    "RtrlCanaryAwaitingApproval",
    "RtrlOperatorCommandRefused",
}
ALERT_FILES = sorted(ct.ALERTS.glob("*.yaml"))


@pytest.fixture(scope="module")
def promtool() -> str:
    return ct.tool("promtool")


def test_the_required_alerts_exist() -> None:
    names = [rule["alert"] for rule in ct.alert_rules()]
    assert len(names) == len(set(names)), "alert names must be unique"
    assert REQUIRED_ALERTS <= set(names)


@pytest.mark.parametrize("rule", ct.alert_rules(), ids=lambda r: r["alert"])
def test_alert_has_severity_summary_description_and_runbook(rule: dict[str, Any]) -> None:
    assert rule["labels"]["severity"] in {"critical", "warning", "info"}
    annotations = rule["annotations"]
    assert annotations["summary"].strip() and annotations["description"].strip()
    assert annotations["runbook_url"] == f"{ct.DEFAULT_RUNBOOK_BASE}/{rule['alert']}.md"
    runbook = ct.RUNBOOKS / f"{rule['alert']}.md"
    assert runbook.exists(), f"write {runbook.relative_to(ct.ROOT)}"
    text = runbook.read_text()
    for heading in ("## What it means", "## What to check", "## What to do"):
        assert heading in text, f"{runbook.name} lacks '{heading}'"


def test_operations_doc_links_every_runbook() -> None:
    ops = (ct.ROOT / "docs" / "operations.md").read_text()
    for rule in ct.alert_rules():
        assert f"runbooks/{rule['alert']}.md" in ops, rule["alert"]


@pytest.mark.parametrize("path", ALERT_FILES, ids=lambda p: p.name)
def test_promtool_check_rules(promtool: str, path: Path) -> None:
    proc = ct.run([promtool, "check", "rules", str(path)])
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("path", ALERT_FILES, ids=lambda p: p.name)
def test_promtool_unit_tests_fire_and_stay_quiet_for_each_alert(promtool: str, path: Path) -> None:
    test_file = ct.ALERT_TESTS / f"{path.stem}_test.yaml"
    assert test_file.exists(), f"each alert group needs {test_file.relative_to(ct.ROOT)}"
    spec = yaml.safe_load(test_file.read_text())
    assert spec["rule_files"] == [f"../../rtrl/files/alerts/{path.name}"], "test the shipped file itself"
    cases = [case for test in spec["tests"] for case in test.get("alert_rule_test", [])]
    for groups in [yaml.safe_load(path.read_text())["groups"]]:
        for rule in (r for g in groups for r in g["rules"] if "alert" in r):
            mine = [c for c in cases if c["alertname"] == rule["alert"]]
            assert any(c["exp_alerts"] for c in mine), f"no firing case for {rule['alert']}"
            assert any(not c["exp_alerts"] for c in mine), f"no quiet case for {rule['alert']}"
    proc = ct.run([promtool, "test", "rules", str(test_file)])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_prometheusrule_ships_the_alert_files_with_the_configured_runbook_base(render: Render) -> None:
    base = "https://wiki.example.com/rtrl/runbooks"
    (rule,) = by_kind(render(*ct.REQUIRED, "--set", "prometheusRule.enabled=true",
                             "--set", f"prometheusRule.runbookBaseUrl={base}"), "PrometheusRule")
    expected = [
        g for path in ALERT_FILES
        for g in yaml.safe_load(path.read_text().replace(ct.DEFAULT_RUNBOOK_BASE, base))["groups"]
    ]
    assert rule["spec"]["groups"] == expected


# --- dashboard ----------------------------------------------------------------------------
def _dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(ct.DASHBOARD.read_text())
    return data


def test_dashboard_covers_the_loop() -> None:
    board = _dashboard()
    rows = [p["title"] for p in board["panels"] if p["type"] == "row"]
    assert rows == ["Ingest", "Rewards", "Training", "Canary cohorts", "Promotions and rollbacks"]
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    assert all(p["datasource"]["uid"] == "${datasource}" for p in board["panels"] if p["type"] != "row")


def test_scoped_adds_the_install_matchers_to_every_rtrl_selector() -> None:
    scope = dashboard.SCOPE
    assert dashboard.scoped("sum(rate(rtrl_a_total[5m]))") == f"sum(rate(rtrl_a_total{{{scope}}}[5m]))"
    assert dashboard.scoped('rtrl_b{result!="sent"} / rtrl_c') == \
        f'rtrl_b{{{scope}, result!="sent"}} / rtrl_c{{{scope}}}'
    assert dashboard.scoped("time() - max(up)") == "time() - max(up)"


def test_every_dashboard_series_is_scoped_to_the_chosen_install() -> None:
    board = _dashboard()
    names = [v["name"] for v in board["templating"]["list"]]
    assert names == ["datasource", "namespace", "release"]
    for expr in dashboard.expressions(board):
        for match in re.finditer(r"\brtrl_(?!service\b)\w+", expr):  # rtrl_service: a label
            rest = expr[match.end():]
            assert rest.startswith("{" + dashboard.SCOPE), f"unscoped {match.group()} in {expr}"


def test_every_panel_says_what_it_shows_and_decisions_are_marked() -> None:
    board = _dashboard()
    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert all(len(p.get("description", "")) > 20 for p in panels), [p["title"] for p in panels]
    kinds = {p["title"]: p["type"] for p in panels}
    assert kinds["Canary phase"] == kinds["Serving version by arm"] == "state-timeline"
    exprs = " ".join(t["expr"] for p in panels for t in p["targets"])
    assert "histogram_quantile(0.99" in exprs  # the latency guardrail's quantile
    assert 'rtrl_gateway_exposures_total{' in exprs and 'result!="sent"' in exprs
    marks = {a["name"]: a["expr"] for a in board["annotations"]["list"]}
    assert set(marks) == {"Promotions", "Rollbacks", "Aborts"}
    assert all("rtrl_canary_" in e for e in marks.values())


def test_dashboard_promql_parses(promtool: str, tmp_path: Path) -> None:
    exprs = dashboard.expressions(_dashboard())
    assert len(exprs) > 25
    rules = [
        {"record": f"rtrl:dashboard_check:{i}", "expr": re.sub(r"\$__rate_interval", "5m", expr)}
        for i, expr in enumerate(exprs)
    ]
    path = tmp_path / "dashboard_rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    proc = ct.run([promtool, "check", "rules", str(path)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(rules)} rules found" in proc.stdout


def test_prometheusrule_writes_the_slo_values_the_approval_wait_and_the_chart_name_in(
    render: Render, tmp_path: Path,
) -> None:
    values = tmp_path / "slo.yaml"
    values.write_text(yaml.safe_dump({"nameOverride": "loop", "prometheusRule": {
        "enabled": True, "slo": {"availability": 0.99, "latency": 0.95, "latencyThresholdSeconds": "2.5"},
        "approvalWaitSeconds": 7200}}))
    (rule,) = by_kind(render(*ct.REQUIRED, "-f", str(values)), "PrometheusRule")
    exprs = {r["alert"]: r["expr"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}
    assert "14.4 * (1 - 0.99)" in exprs["RtrlGatewayErrorBudgetBurn"]
    assert "0.999" not in exprs["RtrlGatewayErrorBudgetBurn"]
    assert "14.4 * (1 - 0.95)" in exprs["RtrlGatewayLatencyBudgetBurn"]
    latency = exprs["RtrlGatewayLatencyBudgetBurn"]
    assert 'le="2.5"' in latency and 'le="5.0"' not in latency
    assert "rtrl_canary_phase_age_seconds > 7200" in exprs["RtrlCanaryAwaitingApproval"]
    assert "> 3600" not in exprs["RtrlCanaryAwaitingApproval"]
    assert "rtrl_canary_phase_age_seconds > 23400" in exprs["RtrlCanaryStuck"]  # only the approval wait
    assert 'app_kubernetes_io_name="loop"' in exprs["RtrlServiceDown"]
    assert 'app_kubernetes_io_name="rtrl"' not in exprs["RtrlWorkerDown"]
    (monitor_doc,) = by_kind(render(*ct.REQUIRED, "--set", "serviceMonitor.enabled=true"), "ServiceMonitor")
    assert {"app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component"} <= set(
        monitor_doc["spec"]["targetLabels"])
