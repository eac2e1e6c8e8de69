"""The Grafana dashboard for the loop, built from a short list of panels so the PromQL is
easy to read and to check. ``python helm/generate.py`` writes it to
helm/rtrl/files/dashboards/rtrl.json; tests/unit/test_chart_rules.py runs every
expression through ``promtool check rules`` and tests/unit/test_metric_names.py checks
every metric name against ingest/contracts/prometheus.py.

Every series is scoped to the ``namespace`` and ``release`` variables (the target labels
the chart's ServiceMonitor adds), so one Grafana can watch several installs apart; the
panels are written without them and :func:`scoped` adds the matchers to each selector.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

RATE = "$__rate_interval"
SCOPE = 'namespace=~"$namespace", app_kubernetes_io_instance=~"$release"'
"""Matchers added to every rtrl series: the install(s) picked in the variables."""


class Panel(NamedTuple):
    title: str
    unit: str
    description: str
    targets: list[tuple[str, str]]  # (legend, expr)
    kind: str = "timeseries"


ROWS: list[tuple[str, list[Panel]]] = [
    ("Ingest", [
        Panel("Raw events by result", "ops", "Events ingest read from the raw topic, by outcome.", [
            ("{{result}}", f"sum by (result) (rate(rtrl_ingest_events_total[{RATE}]))"),
        ]),
        Panel("Dead-lettered events by reason", "ops",
              "Events sent to the dead-letter topic, by reason code (docs/events.md lists them).", [
                  ("{{reason}}", f"sum by (reason) (rate(rtrl_ingest_rejected_total[{RATE}]))"),
              ]),
        Panel("Pipeline lag (from the broker)", "s",
              "How long the oldest record each consumer group has not committed has waited, read "
              "from the broker by the deployer: it keeps growing when a consumer is dead. "
              "RtrlPipelineLagHigh fires above 15 minutes.", [
                  ("{{group}} {{topic}}", "max by (group, topic) (rtrl_group_lag_seconds)"),
              ]),
        Panel("Consumer lag (reported by consumers)", "short",
              "Records behind the partitions' ends, as each live consumer sees them.", [
                  ("{{rtrl_service}} {{topic}}", "sum by (rtrl_service, topic) (rtrl_consumer_lag_messages)"),
              ]),
        Panel("Batch processing p95", "s", "Time to process one polled batch, per service.", [
            ("{{rtrl_service}}", "histogram_quantile(0.95, sum by (rtrl_service, le) "
                            f"(rate(rtrl_batch_processing_seconds_bucket[{RATE}])))"),
        ]),
    ]),
    ("Rewards", [
        Panel("Rewards emitted by arm", "ops",
              "Reward records written, by arm; defaulted=true when a window closed without the "
              "client's outcome events.", [
                  ("{{arm}} defaulted={{defaulted}}",
                   f"sum by (arm, defaulted) (rate(rtrl_rewards_emitted_total[{RATE}]))"),
              ]),
        Panel("Mean reward by arm", "short",
              "Mean emitted reward per arm: (positive sum - negative sum) / count.", [
                  ("{{arm}}", f"(sum by (arm) (rate(rtrl_reward_value_positive_total[{RATE}])) "
                              f"- sum by (arm) (rate(rtrl_reward_value_negative_total[{RATE}]))) "
                              f"/ sum by (arm) (rate(rtrl_reward_value_count[{RATE}]))"),
              ]),
        Panel("Open reward windows", "short", "Exposures waiting for their attribution window to close.", [
            ("open", "sum(rtrl_reward_open_windows)"),
        ]),
        Panel("Most overdue open window", "s",
              "Seconds the most overdue window is past its close time: grows when the reward "
              "worker stalls.", [
                  ("overdue", "max(rtrl_reward_oldest_open_window_overdue_seconds)"),
              ]),
        Panel("Late and orphan events", "ops",
              "Outcome events after their window closed (late) or for an unknown request (orphans).", [
                  ("late {{type}}", f"sum by (type) (rate(rtrl_reward_late_events_total[{RATE}]))"),
                  ("orphans", f"sum(rate(rtrl_reward_orphan_events_total[{RATE}]))"),
              ]),
        Panel("Reward close latency p95", "s", "From a window's close time to its reward record.", [
            ("p95", "histogram_quantile(0.95, sum by (le) "
                    f"(rate(rtrl_reward_close_latency_seconds_bucket[{RATE}])))"),
        ]),
    ]),
    ("Training", [
        Panel("Increments by outcome (1h)", "short", "RL increments finished in the last hour, by outcome.", [
            ("{{outcome}}", "sum by (outcome) (increase(rtrl_trainer_increments_total[1h]))"),
        ]),
        Panel("Time since last candidate", "s",
              "RtrlTrainingOverdue fires when the first line crosses the second.", [
                  ("since last", "time() - max(rtrl_trainer_last_success_timestamp_seconds)"),
                  ("2 x cadence", "2 * max(rtrl_trainer_cadence_seconds)"),
              ]),
        Panel("Increment running", "short", "1 while an increment trains.", [
            ("running", "max(rtrl_trainer_increment_running)"),
        ]),
        Panel("Increment duration p50", "s", "Median wall time of an increment, trigger to registered.", [
            ("p50", "histogram_quantile(0.5, sum by (le) (rate(rtrl_trainer_increment_seconds_bucket[1d])))"),
        ]),
        Panel("Last increment statistics", "short",
              "Loss, KL, clip fraction, ESS and more of the last increment.", [
            ("{{stat}}", "max by (stat) (rtrl_trainer_last_increment_stat)"),
        ]),
        Panel("Offline gate results (1d)", "short", "Candidates the offline gate passed or refused.", [
            ("{{result}}", "sum by (result) (increase(rtrl_gate_results_total[1d]))"),
        ]),
    ]),
    ("Canary cohorts", [
        Panel("Canary phase", "short", "The deployer's canary phase over time.", [
            ("{{phase}}", "max by (phase) (rtrl_canary_phase)"),
        ], kind="state-timeline"),
        Panel("Serving version by arm", "short", "The model version each arm of the gateway serves.", [
            ("{{arm}} v{{version}}", "max by (arm, version) (rtrl_gateway_serving_version)"),
        ], kind="state-timeline"),
        Panel("Canary weight", "percentunit", "Share of users routed to the canary.", [
            ("weight", "max(rtrl_canary_weight)"),
        ]),
        Panel("Requests by arm", "reqps", "Gateway requests per second by arm and version.", [
            ("{{arm}} {{version}}", f"sum by (arm, version) (rate(rtrl_gateway_requests_total[{RATE}]))"),
        ]),
        Panel("Error ratio by arm", "percentunit", "Share of gateway requests that failed, by arm.", [
            ("{{arm}}", f"sum by (arm) (rate(rtrl_gateway_errors_total[{RATE}])) "
                        f"/ sum by (arm) (rate(rtrl_gateway_requests_total[{RATE}]))"),
        ]),
        Panel("Latency p50 and p99 by arm", "s",
              "Gateway latency by arm; the judge's latency guardrail compares the arms at p99.", [
                  ("{{arm}} p99", "histogram_quantile(0.99, sum by (arm, le) "
                                  f"(rate(rtrl_gateway_request_seconds_bucket[{RATE}])))"),
                  ("{{arm}} p50", "histogram_quantile(0.5, sum by (arm, le) "
                                  f"(rate(rtrl_gateway_request_seconds_bucket[{RATE}])))"),
              ]),
        Panel("Exposure events not delivered", "ops",
              "completion.served events the gateway could not hand to the broker: training data "
              "lost. RtrlExposuresLost fires on any.", [
                  ("{{result}}", "sum by (result) "
                                 f"(rate(rtrl_gateway_exposures_total{{result!=\"sent\"}}[{RATE}]))"),
              ]),
        Panel("Judge statistics", "short", "The always-valid judge's latest statistics per metric.", [
            ("{{metric}} {{stat}}", "max by (metric, stat) (rtrl_judge_statistic)"),
        ]),
        Panel("Canary plan: users to a decision", "short",
              "Per primary metric, the canary users so far and those the judge needs to promote a "
              "candidate that is no worse (docs/judge.md, Planning); -1: not known yet.", [
                  ("{{metric}} {{stat}}", 'max by (metric, stat) (rtrl_canary_plan{stat!="eta_seconds"})'),
              ]),
        Panel("Canary plan: time to a decision", "s",
              "When every primary metric has its planned users at the traffic so far (-1: unknown).", [
                  ("eta", "max(rtrl_canary_decision_eta_seconds)"),
              ]),
        Panel("Judge verdicts", "short", "Verdicts of the judge per tick.", [
            ("{{verdict}}", f"sum by (verdict) (increase(rtrl_canary_verdicts_total[{RATE}]))"),
        ]),
        Panel("Canary fallbacks to stable", "ops",
              "Canary requests served by stable because the canary failed.", [
            ("fallbacks", f"sum(rate(rtrl_gateway_canary_fallbacks_total[{RATE}]))"),
        ]),
    ]),
    ("Promotions and rollbacks", [
        Panel("Rollbacks (1d)", "short", "Canaries rolled back in the last day, by reason and by whom.", [
            ("{{reason}} by {{decided_by}}",
             "sum by (reason, decided_by) (increase(rtrl_canary_rollbacks_total[1d]))"),
        ]),
        Panel("Champion vs long-term holdout", "percentunit",
              "The champion's relative change against the users held out on the pinned baseline, "
              "same minutes (docs/holdout.md); RtrlHoldoutRegression fires when the always-valid "
              "interval shows the champion worse.", [
                  ("{{metric}}", 'max by (metric) (rtrl_holdout_effect{stat="relative"}) '
                                 "and on () max(rtrl_holdout_active) == 1"),
              ]),
        Panel("Promotions (1d)", "short", "Candidates promoted in the last day, by whom.", [
            ("{{decided_by}}", "sum by (decided_by) (increase(rtrl_canary_promotions_total[1d]))"),
        ]),
        Panel("Aborted canaries (1d)", "short", "Canaries aborted (inconclusive, errors), by reason.", [
            ("{{reason}}", "sum by (reason) (increase(rtrl_canary_aborts_total[1d]))"),
        ]),
        Panel("Reward-hacking detections (1d)", "short", "Reward-hacking detectors that fired.", [
            ("{{detector}}", "sum by (detector) (increase(rtrl_reward_hacking_detections_total[1d]))"),
        ]),
    ]),
]

# (name, colour, expr, title, text): a mark on every panel's time axis for each decision
ANNOTATIONS: list[tuple[str, str, str, str, str]] = [
    ("Promotions", "green", "sum by (decided_by) (increase(rtrl_canary_promotions_total[2m])) > 0",
     "promoted", "decided by {{decided_by}}"),
    ("Rollbacks", "red", "sum by (reason, decided_by) (increase(rtrl_canary_rollbacks_total[2m])) > 0",
     "rolled back", "{{reason}} (decided by {{decided_by}})"),
    ("Aborts", "orange", "sum by (reason) (increase(rtrl_canary_aborts_total[2m])) > 0",
     "aborted", "{{reason}}"),
]

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
_SELECTOR = re.compile(r"\b(?!rtrl_service\b)(rtrl_[A-Za-z0-9_:]+)(\{([^}]*)\})?")
"""An rtrl series selector (``rtrl_service`` is a label, not a series)."""


def scoped(expr: str) -> str:
    """``expr`` with the install's matchers added to every rtrl series selector."""
    def add(match: re.Match[str]) -> str:
        inner = match.group(3)
        return f"{match.group(1)}{{{SCOPE}{', ' + inner if inner else ''}}}"
    return _SELECTOR.sub(add, expr)


def _field_config(panel: Panel) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": panel.unit}
    if panel.kind == "state-timeline":  # 1 = this state holds, 0 = it does not: show only the 1s
        defaults["mappings"] = [{"type": "value", "options": {
            "0": {"text": " ", "color": "transparent", "index": 0},
            "1": {"text": "on", "color": "green", "index": 1}}}]
        defaults["color"] = {"mode": "fixed", "fixedColor": "green"}
    return {"defaults": defaults, "overrides": []}


def _panel(pid: int, panel: Panel, x: int, y: int) -> dict[str, Any]:
    options: dict[str, Any] = {"legend": {"displayMode": "list", "placement": "bottom"}}
    if panel.kind == "state-timeline":
        options = {"showValue": "never", "mergeValues": True, "legend": {"showLegend": False}}
    return {
        "id": pid,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": 8, "x": x, "y": y},
        "fieldConfig": _field_config(panel),
        "options": options,
        "targets": [
            {"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": scoped(expr),
             "legendFormat": legend}
            for i, (legend, expr) in enumerate(panel.targets)
        ],
    }


def _variables() -> list[dict[str, Any]]:
    def query(name: str, label: str, q: str) -> dict[str, Any]:
        return {"name": name, "label": label, "type": "query", "datasource": DATASOURCE,
                "query": {"query": q, "refId": name}, "definition": q, "refresh": 2, "sort": 1,
                "multi": True, "includeAll": True, "allValue": ".*",
                "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "hide": 0}
    return [
        {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
         "current": {}, "hide": 0},
        query("namespace", "Namespace", "label_values(rtrl_build_info, namespace)"),
        query("release", "Release",
              'label_values(rtrl_build_info{namespace=~"$namespace"}, app_kubernetes_io_instance)'),
    ]


def _annotations() -> list[dict[str, Any]]:
    return [{"name": name, "datasource": DATASOURCE, "enable": True, "iconColor": colour,
             "expr": scoped(expr), "step": "1m", "titleFormat": title, "textFormat": text,
             "useValueForTime": False}
            for name, colour, expr, title, text in ANNOTATIONS]


def build() -> dict[str, Any]:
    """The dashboard as Grafana's JSON model."""
    panels: list[dict[str, Any]] = []
    pid, y = 1, 0
    for row_title, row_panels in ROWS:
        panels.append({"id": pid, "type": "row", "title": row_title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        pid, y = pid + 1, y + 1
        for i, panel in enumerate(row_panels):
            panels.append(_panel(pid, panel, x=(i % 3) * 8, y=y + (i // 3) * 8))
            pid += 1
        y += ((len(row_panels) + 2) // 3) * 8
    return {
        "uid": "rtrl-loop",
        "title": "rtrl: real-time RL loop",
        "description": "Ingest, rewards, training and the canary of one or more rtrl installs "
                       "(pick them with Namespace and Release). Promotions, rollbacks and aborts "
                       "are marked on every panel.",
        "tags": ["rtrl"],
        "timezone": "utc",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-24h", "to": "now"},
        "templating": {"list": _variables()},
        "annotations": {"list": _annotations()},
        "panels": panels,
    }


def expressions(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression of a dashboard: panels (nested in rows too) and annotations."""
    found: list[str] = []
    for panel in dashboard["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            found += [t["expr"] for t in inner.get("targets", []) if t.get("expr")]
    found += [a["expr"] for a in dashboard.get("annotations", {}).get("list", []) if a.get("expr")]
    return found
