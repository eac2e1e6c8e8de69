"""The Grafana dashboard for the loop, built from a short list of panels so the PromQL is
easy to read and to check. ``python helm/generate.py`` writes it to
helm/rtrl/files/dashboards/rtrl.json; tests/unit/test_chart_rules.py runs every
expression through ``promtool check rules`` and tests/unit/test_metric_names.py checks
every metric name against services/runtime/metrics.py.
"""

from __future__ import annotations

from typing import Any

RATE = "$__rate_interval"

# (row title, [(panel title, unit, [(legend, expr), ...]), ...])
ROWS: list[tuple[str, list[tuple[str, str, list[tuple[str, str]]]]]] = [
    ("Ingest", [
        ("Raw events by result", "ops", [
            ("{{result}}", f"sum by (result) (rate(rtrl_ingest_events_total[{RATE}]))"),
        ]),
        ("Dead-lettered events by reason", "ops", [
            ("{{reason}}", f"sum by (reason) (rate(rtrl_ingest_rejected_total[{RATE}]))"),
        ]),
        ("Consumer lag", "short", [
            ("{{service}} {{topic}}", "sum by (service, topic) (rtrl_consumer_lag_messages)"),
        ]),
        ("Batch processing p95", "s", [
            ("{{service}}", "histogram_quantile(0.95, sum by (service, le) "
                            f"(rate(rtrl_batch_processing_seconds_bucket[{RATE}])))"),
        ]),
    ]),
    ("Rewards", [
        ("Rewards emitted by arm", "ops", [
            ("{{arm}} defaulted={{defaulted}}",
             f"sum by (arm, defaulted) (rate(rtrl_rewards_emitted_total[{RATE}]))"),
        ]),
        ("Mean reward by arm", "short", [
            ("{{arm}}", f"(sum by (arm) (rate(rtrl_reward_value_positive_total[{RATE}])) "
                        f"- sum by (arm) (rate(rtrl_reward_value_negative_total[{RATE}]))) "
                        f"/ sum by (arm) (rate(rtrl_reward_value_count[{RATE}]))"),
        ]),
        ("Open reward windows", "short", [
            ("open", "sum(rtrl_reward_open_windows)"),
        ]),
        ("Most overdue open window", "s", [
            ("overdue", "max(rtrl_reward_oldest_open_window_overdue_seconds)"),
        ]),
        ("Late and orphan events", "ops", [
            ("late {{type}}", f"sum by (type) (rate(rtrl_reward_late_events_total[{RATE}]))"),
            ("orphans", f"sum(rate(rtrl_reward_orphan_events_total[{RATE}]))"),
        ]),
        ("Reward close latency p95", "s", [
            ("p95", "histogram_quantile(0.95, sum by (le) "
                    f"(rate(rtrl_reward_close_latency_seconds_bucket[{RATE}])))"),
        ]),
    ]),
    ("Training", [
        ("Increments by outcome (1h)", "short", [
            ("{{outcome}}", "sum by (outcome) (increase(rtrl_trainer_increments_total[1h]))"),
        ]),
        ("Time since last candidate", "s", [
            ("since last", "time() - max(rtrl_trainer_last_success_timestamp_seconds)"),
            ("2 x cadence", "2 * max(rtrl_trainer_cadence_seconds)"),
        ]),
        ("Increment running", "short", [
            ("running", "max(rtrl_trainer_increment_running)"),
        ]),
        ("Increment duration p50", "s", [
            ("p50", "histogram_quantile(0.5, sum by (le) (rate(rtrl_trainer_increment_seconds_bucket[1d])))"),
        ]),
        ("Last increment statistics", "short", [
            ("{{stat}}", "max by (stat) (rtrl_trainer_last_increment_stat)"),
        ]),
        ("Offline gate results (1d)", "short", [
            ("{{result}}", "sum by (result) (increase(rtrl_gate_results_total[1d]))"),
        ]),
    ]),
    ("Canary cohorts", [
        ("Canary weight", "percentunit", [
            ("weight", "max(rtrl_canary_weight)"),
        ]),
        ("Canary phase", "short", [
            ("{{phase}}", "max by (phase) (rtrl_canary_phase) == 1"),
        ]),
        ("Requests by arm", "reqps", [
            ("{{arm}} {{version}}", f"sum by (arm, version) (rate(rtrl_gateway_requests_total[{RATE}]))"),
        ]),
        ("Error ratio by arm", "percentunit", [
            ("{{arm}}", f"sum by (arm) (rate(rtrl_gateway_errors_total[{RATE}])) "
                        f"/ sum by (arm) (rate(rtrl_gateway_requests_total[{RATE}]))"),
        ]),
        ("Latency p95 by arm", "s", [
            ("{{arm}}", "histogram_quantile(0.95, sum by (arm, le) "
                        f"(rate(rtrl_gateway_request_seconds_bucket[{RATE}])))"),
        ]),
        ("Judge statistics", "short", [
            ("{{metric}} {{stat}}", "max by (metric, stat) (rtrl_judge_statistic)"),
        ]),
        ("Judge verdicts", "short", [
            ("{{verdict}}", f"sum by (verdict) (increase(rtrl_canary_verdicts_total[{RATE}]))"),
        ]),
        ("Canary fallbacks to stable", "ops", [
            ("fallbacks", f"sum(rate(rtrl_gateway_canary_fallbacks_total[{RATE}]))"),
        ]),
    ]),
    ("Promotions and rollbacks", [
        ("Rollbacks (1d)", "short", [
            ("{{reason}} by {{decided_by}}",
             "sum by (reason, decided_by) (increase(rtrl_canary_rollbacks_total[1d]))"),
        ]),
        ("Promotions (1d)", "short", [
            ("{{decided_by}}", "sum by (decided_by) (increase(rtrl_canary_promotions_total[1d]))"),
        ]),
        ("Aborted canaries (1d)", "short", [
            ("{{reason}}", "sum by (reason) (increase(rtrl_canary_aborts_total[1d]))"),
        ]),
        ("Reward-hacking detections (1d)", "short", [
            ("{{detector}}", "sum by (detector) (increase(rtrl_reward_hacking_detections_total[1d]))"),
        ]),
    ]),
]

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def _panel(pid: int, title: str, unit: str, targets: list[tuple[str, str]], x: int, y: int) -> dict[str, Any]:
    return {
        "id": pid,
        "type": "timeseries",
        "title": title,
        "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": 8, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": [
            {"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": expr, "legendFormat": legend}
            for i, (legend, expr) in enumerate(targets)
        ],
    }


def build() -> dict[str, Any]:
    """The dashboard as Grafana's JSON model."""
    panels: list[dict[str, Any]] = []
    pid, y = 1, 0
    for row_title, row_panels in ROWS:
        panels.append({"id": pid, "type": "row", "title": row_title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        pid, y = pid + 1, y + 1
        for i, (title, unit, targets) in enumerate(row_panels):
            panels.append(_panel(pid, title, unit, targets, x=(i % 3) * 8, y=y + (i // 3) * 8))
            pid += 1
        y += ((len(row_panels) + 2) // 3) * 8
    return {
        "uid": "rtrl-loop",
        "title": "rtrl: real-time RL loop",
        "tags": ["rtrl"],
        "timezone": "utc",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-24h", "to": "now"},
        "templating": {"list": [{
            "name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
            "current": {}, "hide": 0,
        }]},
        "annotations": {"list": []},
        "panels": panels,
    }


def expressions(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression of a dashboard (panels nested in rows included)."""
    found: list[str] = []
    for panel in dashboard["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            found += [t["expr"] for t in inner.get("targets", []) if t.get("expr")]
    return found
