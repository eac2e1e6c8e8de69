"""Every metric an alert or a dashboard panel uses is one the services really export:
the names are read from the PromQL and looked up in the prometheus_client registry that
ingest/contracts/prometheus.py fills (with the suffixes the exposition adds)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

import ingest.contracts.prometheus as catalogue

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "helm"))
import chart_tools as ct
import dashboard

_CATALOGUE = [c for cs in catalogue.OWNERS.values() for c in cs] + list(catalogue.SHARED)
_SCRAPE_SERIES = {"up"}
"""Series Prometheus writes for every target itself."""
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("_sum", "_count", "_created"),
    "info": ("_info",),
    "gauge": ("",),
    "unknown": ("",),
}
metric_names = ct.metric_names


def _suffixes(family_name: str, family_type: str) -> tuple[str, ...]:
    suffixes = _SUFFIXES.get(family_type, ("",))
    if family_type == "histogram":
        # prometheus_client exports no _sum for a histogram with a bucket below 0
        bounds = next((c._upper_bounds for c in _CATALOGUE if getattr(c, "_name", None) == family_name), [])
        if any(b < 0 for b in bounds):
            suffixes = tuple(s for s in suffixes if s != "_sum")
    return suffixes


def exported_names() -> set[str]:
    """What /metrics can show: sample names, plus the names labelled metrics get once used."""
    names = set()
    for family in REGISTRY.collect():
        names |= {sample.name for sample in family.samples}
        names |= {family.name + suffix for suffix in _suffixes(family.name, family.type)}
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
    missing = used - exported_names() - _SCRAPE_SERIES
    assert not missing, f"{where} uses {sorted(missing)}: not in ingest/contracts/prometheus.py"


def test_the_multiprocess_registry_adds_up_processes_and_keeps_empty_families(tmp_path: Path) -> None:
    """Gateway workers share /metrics through prometheus-client's multiprocess mode: two
    processes' counters are summed, other services' metrics are left out, and a labelled
    metric nobody has set still has its HELP and TYPE (Prometheus's metadata lists it)."""
    import os
    import subprocess

    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    count = ("from ingest.contracts.prometheus import GATEWAY_REQUESTS, GATEWAY_OPEN_CONNECTIONS\n"
             "GATEWAY_REQUESTS.labels('stable', '3', '200').inc(2)\nGATEWAY_OPEN_CONNECTIONS.inc(5)\n")
    for _ in range(2):
        subprocess.run([sys.executable, "-c", count], env=env, check=True, timeout=120)
    show = ("from prometheus_client import generate_latest\n"
            "from ingest.contracts.prometheus import multiprocess_registry\n"
            "print(generate_latest(multiprocess_registry('gateway')).decode())\n")
    out = subprocess.run([sys.executable, "-c", show], env=env, check=True, timeout=120,
                         capture_output=True, text=True).stdout
    assert 'rtrl_gateway_requests_total{arm="stable",code="200",version="3"} 4.0' in out
    assert "rtrl_gateway_open_connections 10.0" in out  # until the parent marks them dead
    assert "# TYPE rtrl_gateway_errors_total counter" in out
    assert "rtrl_trainer_" not in out and "process_cpu_seconds_total" not in out
