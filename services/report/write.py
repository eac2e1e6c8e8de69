"""The demo report: what the loop did, measured from the events, with the ledger to click.

Numbers come from the reward records on the rewards topic (one per served completion,
carrying the version and arm that served it), never from training logs. Decisions come from
the deployer's ledger in MLflow (one run per canary). ``write_report`` writes
``<report_dir>/report.md``, PNG plots, ``summary.json`` and the raw ``rewards.jsonl`` next to
it. The parts: services/report/cohorts.py (the maths and the metric definitions),
report_sources.py (reading the topic and the ledger), report_markdown.py (the text),
report_plots.py (the plots).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rollback.types import JudgePolicy
from services.report import holdout as report_holdout
from services.report import sessions as report_sessions
from services.report.cohorts import (
    Chain,
    Cohort,
    Comparison,
    Row,
    by_version,
    chain_comparison,
    compare,
    parse_ts,
    row_from_record,
    side_by_side,
)
from services.report.holdout import holdout_periods
from services.report.markdown import render_markdown
from services.report.plots import plot_metric
from services.report.sources import Decision

PLOTTED = ("edit_persistence", "latency_ms", "reward")


def write_report(
    report_dir: Path,
    records: Sequence[Mapping[str, Any]],
    decisions: Sequence[Decision],
    *,
    primary_horizon_s: int,
    baseline_version: str | None,
    final_version: str | None,
    bad_version: str | None,
    started: float,
    finished: float,
    command: str,
    mlflow_url: str,
    kinds: Mapping[str, str] | None = None,
    notes: Sequence[str] = (),
    judge_policy: JudgePolicy | None = None,
    bad_versions: Sequence[str] = (),
) -> Path:
    """Write report.md, the plots and summary.json into ``report_dir``; return report.md.
    ``bad_versions``: every deliberately bad candidate, in order (default: ``bad_version``)."""
    bads = list(bad_versions) or ([bad_version] if bad_version else [])
    report_dir.mkdir(parents=True, exist_ok=True)
    rows = [row_from_record(r, primary_horizon_s) for r in records]
    cohorts = by_version(rows)
    comparison = before_after(cohorts, baseline_version, final_version)
    t0 = min((r.served_ts for r in rows), default=started)
    plots = draw_plots(rows, t0, report_dir, decisions)
    concurrent = promotions_side_by_side(rows, decisions)
    periods = holdout_periods(records, rows, decisions, baseline_version, finished,
                              judge_policy or JudgePolicy())
    chain = None
    if comparison is not None:
        chain = chain_comparison([(d.stable, d.candidate, st, ca) for d, st, ca in concurrent],
                                 comparison.baseline, comparison.final)
    srows = report_sessions.session_rows(records)
    stable = report_sessions.by_version_arm(srows)
    speriods = report_sessions.periods_against_holdout(
        srows, [(p.champion, p.pinned, p.start, p.end) for p in periods if p.champion != p.pinned])
    md = render_markdown(
        title="rtrl closed-loop demo", command=command, started=started, finished=finished,
        cohorts=cohorts, comparison=comparison, decisions=decisions, bad_version=bad_version,
        bad_versions=bads,
        mlflow_url=mlflow_url, plots=plots, notes=notes, kinds=kinds, concurrent=concurrent,
        chain=chain, holdout=[*report_holdout.section(periods), *report_sessions.section(stable, speriods)],
        horizon_s=primary_horizon_s,
    )
    path = report_dir / "report.md"
    path.write_text(md)
    summary = summarise(cohorts, comparison, chain, decisions, concurrent, bad_version, kinds, len(rows))
    summary["holdout"] = report_holdout.summary(periods)
    summary["bad_versions"] = bads
    summary["sessions"] = report_sessions.summary(stable, speriods)
    summary["persistence_horizon_s"] = primary_horizon_s
    with open(report_dir / "rewards.jsonl", "w") as fh:  # the raw evidence, to recompute anything
        fh.writelines(json.dumps(r, default=str) + "\n" for r in records)
    (report_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str, allow_nan=True))
    return path


def before_after(cohorts: Mapping[str, Cohort], baseline: str | None, final: str | None,
                 ) -> Comparison | None:
    """The bootstrap champion against the last promoted one, when both served and differ."""
    if baseline and final and baseline != final and baseline in cohorts and final in cohorts:
        return compare(cohorts, baseline, final)
    return None


def draw_plots(rows: Sequence[Row], t0: float, report_dir: Path, decisions: Sequence[Decision],
               ) -> list[str]:
    """One PNG per plotted metric in ``report_dir``; their file names."""
    plots = []
    for metric in PLOTTED:
        name = f"{metric}.png"
        plot_metric(rows, t0, metric, report_dir / name, decisions)
        plots.append(name)
    return plots


def promotions_side_by_side(rows: Sequence[Row], decisions: Sequence[Decision],
                            ) -> list[tuple[Decision, Cohort, Cohort]]:
    """Each promotion with its stable and canary arms over the canary's own minutes (a
    decision whose time does not parse is left out)."""
    out = []
    for d in decisions:
        if d.outcome != "promoted":
            continue
        try:
            end = parse_ts(d.decided_at)
        except ValueError:
            continue
        st, ca = side_by_side(rows, d.stable, d.candidate, d.started_at, end)
        out.append((d, st, ca))
    return out


def summarise(cohorts: Mapping[str, Cohort], comparison: Comparison | None, chain: Chain | None,
              decisions: Sequence[Decision], concurrent: Sequence[tuple[Decision, Cohort, Cohort]],
              bad_version: str | None, kinds: Mapping[str, str] | None, n_records: int,
              ) -> dict[str, Any]:
    """summary.json: the report's figures for programs (the e2e test, rtrl demo's last lines)."""
    return {
        "cohorts": {v: asdict(c) for v, c in cohorts.items()},
        "comparison": asdict(comparison) if comparison else None,
        "chain": asdict(chain) if chain else None,
        "decisions": [asdict(d) for d in decisions],
        "side_by_side": [{"stable": d.stable, "candidate": d.candidate, "stable_cohort": asdict(st),
                          "canary_cohort": asdict(ca)} for d, st, ca in concurrent],
        "bad_version": bad_version,
        "kinds": dict(kinds or {}),
        "records": n_records,
    }
