"""Every metric an alert or a dashboard panel uses is one the services really export:
the names are read from the PromQL and looked up in the prometheus_client registry that
services/runtime/metrics.py fills (with the suffixes the exposition adds)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

import services.runtime.metrics  # noqa: F401 - registers the catalogue

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "helm"))
import chart_tools as ct
import dashboard

_KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
             "bool", "offset", "inf", "nan", "atan2"}
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("_sum", "_count", "_created"),
    "info": ("_info",),
    "gauge": ("",),
    "unknown": ("",),
}


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (functions, keywords, labels and durations removed)."""
    text = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)  # string literals
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges and subqueries
    names = set()
    for match in re.finditer(r"(?<![\w.$])[A-Za-z_:][\w:]*", text):
        rest = text[match.end():]
        if re.match(r"\s*\(", rest) or match.group() in _KEYWORDS:
            continue  # a function call or an operator keyword
        names.add(match.group())
    return names


def exported_names() -> set[str]:
    """What /metrics can show: sample names, plus the names labelled metrics get once used."""
    names = set()
    for family in REGISTRY.collect():
        names |= {sample.name for sample in family.samples}
        names |= {family.name + suffix for suffix in _SUFFIXES.get(family.type, ("",))}
    return names


def test_parser_finds_metric_names_and_nothing_else() -> None:
    expr = ('histogram_quantile(0.95, sum by (arm, le) (rate(rtrl_gateway_request_seconds_bucket'
            '{arm="canary", code=~"5.."}[5m]))) / on(job) group_left(version) foo:bar offset 5m '
            'and time() - process_start_time_seconds > 2 * rtrl_x unless bool_y')
    assert metric_names(expr) == {
        "rtrl_gateway_request_seconds_bucket", "foo:bar", "process_start_time_seconds", "rtrl_x", "bool_y",
    }


def test_registry_names_carry_the_exposition_suffixes() -> None:
    names = exported_names()
    assert {"rtrl_ingest_events_total", "rtrl_gateway_request_seconds_bucket", "rtrl_build_info",
            "rtrl_consumer_lag_messages", "process_start_time_seconds"} <= names
    assert "rtrl_does_not_exist_total" not in names


def _alert_exprs() -> list[tuple[str, str]]:
    return [(rule["alert"], rule["expr"]) for rule in ct.alert_rules()]


def _dashboard_exprs() -> list[tuple[str, str]]:
    board = json.loads(ct.DASHBOARD.read_text())
    return [(f"panel expr {i}", e) for i, e in enumerate(dashboard.expressions(board))]


@pytest.mark.parametrize(("where", "expr"), _alert_exprs() + _dashboard_exprs(), ids=lambda x: str(x)[:40])
def test_every_metric_used_is_exported(where: str, expr: str) -> None:
    used = metric_names(expr)
    assert used, f"{where}: no metric found in {expr!r}"
    missing = used - exported_names()
    assert not missing, f"{where} uses {sorted(missing)}: not in services/runtime/metrics.py"
