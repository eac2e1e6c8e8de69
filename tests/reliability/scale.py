"""Sizes of the reliability suite. CI runs the bounded sizes; ``RTRL_RELIABILITY_SCALE=soak``
(what ``scripts/reliability`` sets) runs the full ones the docs report."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Scale:
    name: str
    crash_events: int
    """Events streamed through ingest and reward while workers are SIGKILLed."""
    crash_kills: int
    """SIGKILLs (ingest and reward workers together) during that stream."""
    fault_events: int
    """Events streamed while the broker or Redis is restarted."""
    fuzz_bad: int
    """Malformed or hostile events in the fuzz corpus."""
    fuzz_valid_requests: int
    """Valid requests (each a full event sequence) mixed into the fuzz corpus."""
    soak_seconds: float
    """How long the load soak sustains the pipeline's benchmarked rate."""
    judge_canaries: int
    """Simulated A/A and A/B canaries for the judge's statistical checks."""
    idle_seconds: float
    """How long idle ingest and reward workers (lag 0) are measured for their CPU."""
    scale_out_events: int
    """Events streamed while ingest and reward workers join and die on 8 partitions."""
    flood_seconds: float
    """How long real clients are measured while silent and slowloris connections flood the gateway."""
    alert_outages: tuple[tuple[str, float | None], ...]
    """(dependency, seconds stopped) in turn under the live services and the shipped alert rules;
    None: until its critical alert fires."""
    alert_quiet_s: float
    """How long no alert may be pending or firing before each of those outages."""
    alert_scrape_s: float
    """Prometheus's scrape and evaluation interval in that test (the chart's default is 30 s)."""
    alert_all_clear: bool
    """Whether every alert, not only the critical ones, must clear after each outage (the
    warnings' 5-minute rate windows take that long)."""


SCALES = {
    "ci": Scale("ci", crash_events=12_000, crash_kills=4, fault_events=4_000, fuzz_bad=10_000,
                fuzz_valid_requests=300, soak_seconds=45, judge_canaries=1_000, idle_seconds=30,
                scale_out_events=6_000, flood_seconds=10, alert_outages=(("kafka", None),),
                alert_quiet_s=30, alert_scrape_s=10, alert_all_clear=False),
    "soak": Scale("soak", crash_events=100_000, crash_kills=16, fault_events=20_000, fuzz_bad=10_000,
                  fuzz_valid_requests=2_000, soak_seconds=900, judge_canaries=2_000, idle_seconds=300,
                  scale_out_events=40_000, flood_seconds=120,
                  alert_outages=(("kafka", 720.0), ("redis", 300.0)), alert_quiet_s=120,
                  alert_scrape_s=30, alert_all_clear=True),
}


def current() -> Scale:
    name = os.environ.get("RTRL_RELIABILITY_SCALE", "ci")
    if name not in SCALES:
        raise ValueError(f"RTRL_RELIABILITY_SCALE={name!r}: expected one of {sorted(SCALES)}")
    return SCALES[name]


def named(test: str, client: str) -> str:
    """The record name of a test run on a Kafka client: the test's own name on the default
    client (kafka-python), ``<test>_<client>`` on another."""
    return test if client == "kafka-python" else f"{test}_{client}"


def record(test: str, figures: dict[str, Any]) -> Path:
    """Write one test's measured figures to ``$RTRL_RELIABILITY_OUT/<test>.json`` (default
    ``reports/reliability``) and print them, so the docs' table can be rebuilt from a run."""
    out = Path(os.environ.get("RTRL_RELIABILITY_OUT", "reports/reliability"))
    out.mkdir(parents=True, exist_ok=True)
    doc = {"test": test, "scale": asdict(current()), "figures": figures}
    path = out / f"{test}.json"
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    print(f"\nRELIABILITY {test}: {json.dumps(figures, sort_keys=True)}")
    return path
