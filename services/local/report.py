"""The demo report: what the loop did, measured from the events, with the ledger to click.

Numbers come from the reward records on the rewards topic (one per served completion,
carrying the version and arm that served it), never from training logs. Decisions come from
the deployer's ledger in MLflow (one run per canary). ``write_report`` writes
``<report_dir>/report.md`` and PNG plots next to it.

Metric definitions (per version, over all the completions it served, either arm):

- edit persistence: mean retained/inserted ratio at the reward spec's primary horizon, over
  accepted edits (the nearest observed horizon when the primary one is missing);
- mean latency: mean ``latency_ms`` of served completions;
- reward: mean reward; acceptance: accepted / edits with accept-reject feedback;
- edit rate: share of completions that propose an edit (the reward-hacking tell).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

# --------------------------------------------------------------------------- pure part


@dataclass(frozen=True)
class Row:
    """The parts of one reward record the report uses."""

    served_ts: float
    version: str
    arm: str
    kind: str
    accepted: bool | None
    persistence: float | None
    latency_ms: float
    reward: float
    dissatisfied: int


def _ts(value: Any) -> float:
    if isinstance(value, int | float):
        return float(value)
    return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()


def primary_persistence(persistence: Mapping[str, float], primary_s: int) -> float | None:
    """The ratio at the primary horizon, else at the nearest observed one (shorter on a tie)."""
    if not persistence:
        return None
    nearest = min(persistence, key=lambda h: (abs(int(float(h)) - primary_s), int(float(h))))
    return float(persistence[nearest])


def row_from_record(rec: Mapping[str, Any], primary_s: int) -> Row:
    accepted = rec.get("accepted")
    return Row(
        served_ts=_ts(rec["served_ts"]),
        version=str(rec["model"]["version"]),
        arm=str(rec.get("arm", "stable")),
        kind=str(rec.get("completion_kind", "edit")),
        accepted=accepted if isinstance(accepted, bool) else None,
        persistence=primary_persistence(rec.get("persistence") or {}, primary_s) if accepted else None,
        latency_ms=float(rec["latency_ms"]),
        reward=float(rec["reward"]),
        dissatisfied=int(rec.get("dissatisfied", 0)),
    )


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def _quantile(xs: Sequence[float], q: float) -> float:
    if not xs:
        return math.nan
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


@dataclass(frozen=True)
class Cohort:
    n: int
    edit_persistence: float
    latency_ms: float
    latency_p95_ms: float
    reward: float
    acceptance: float
    edit_rate: float
    question_rate: float
    dissatisfied_rate: float
    n_persistence: int


def cohort(rows: Sequence[Row]) -> Cohort:
    """The report's metrics over ``rows`` (NaN where a metric has no data)."""
    persist = [r.persistence for r in rows if r.accepted and r.persistence is not None]
    decided = [r for r in rows if r.kind == "edit" and r.accepted is not None]
    n = len(rows)
    return Cohort(
        n=n,
        edit_persistence=_mean(persist),
        latency_ms=_mean([r.latency_ms for r in rows]),
        latency_p95_ms=_quantile([r.latency_ms for r in rows], 0.95),
        reward=_mean([r.reward for r in rows]),
        acceptance=_mean([1.0 if r.accepted else 0.0 for r in decided]),
        edit_rate=_mean([1.0 if r.kind == "edit" else 0.0 for r in rows]),
        question_rate=_mean([1.0 if r.kind == "question" else 0.0 for r in rows]),
        dissatisfied_rate=_mean([1.0 if r.dissatisfied else 0.0 for r in rows]),
        n_persistence=len(persist),
    )


def by_version(rows: Iterable[Row]) -> dict[str, Cohort]:
    groups: dict[str, list[Row]] = {}
    for r in rows:
        groups.setdefault(r.version, []).append(r)
    return {v: cohort(g) for v, g in sorted(groups.items(), key=lambda kv: _vkey(kv[0]))}


def _vkey(v: str) -> tuple[int, str]:
    return (int(v), "") if v.isdigit() else (10**9, v)


def series(rows: Iterable[Row], t0: float, bin_s: float, metric: str,
           ) -> dict[tuple[str, str], list[tuple[float, float]]]:
    """(version, arm) -> [(minutes since t0 at bin centre, metric over the bin)]."""
    bins: dict[tuple[str, str, int], list[Row]] = {}
    for r in rows:
        bins.setdefault((r.version, r.arm, int((r.served_ts - t0) // bin_s)), []).append(r)
    out: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for (v, arm, b), rs in sorted(bins.items(), key=lambda kv: (_vkey(kv[0][0]), kv[0][1], kv[0][2])):
        value = getattr(cohort(rs), metric)
        if not math.isnan(value):
            out.setdefault((v, arm), []).append(((b + 0.5) * bin_s / 60.0, value))
    return out


def relative_change(before: float, after: float) -> float:
    """(after - before) / |before|; NaN when undefined."""
    if math.isnan(before) or math.isnan(after) or before == 0:
        return math.nan
    return (after - before) / abs(before)


@dataclass(frozen=True)
class Targets:
    persistence_up: float = 0.10
    latency_down: float = 0.10


@dataclass(frozen=True)
class Comparison:
    baseline: str
    final: str
    persistence_change: float
    latency_change: float
    persistence_ok: bool
    latency_ok: bool


def compare(cohorts: Mapping[str, Cohort], baseline: str, final: str,
            targets: Targets = Targets()) -> Comparison:
    b, f = cohorts[baseline], cohorts[final]
    dp = relative_change(b.edit_persistence, f.edit_persistence)
    dl = relative_change(b.latency_ms, f.latency_ms)
    return Comparison(baseline, final, dp, dl,
                      persistence_ok=dp >= targets.persistence_up,
                      latency_ok=dl <= -targets.latency_down)


@dataclass(frozen=True)
class Chain:
    """The promotions that lead from the bootstrap champion to the last one, each measured
    side by side during its canary, and their compounded relative change."""

    versions: tuple[str, ...]
    persistence_change: float
    latency_change: float
    persistence_ok: bool
    latency_ok: bool


def chain_comparison(steps: Sequence[tuple[str, str, Cohort, Cohort]], baseline: str, final: str,
                     targets: Targets = Targets()) -> Chain | None:
    """Compound the side-by-side changes of the promotions ``baseline`` → … → ``final``.

    ``steps`` are (stable, candidate, stable cohort, canary cohort) of each promotion in
    decision order. Each step is measured on both arms over the same minutes, so changes in
    machine load (part of every latency) cancel; the product of (1 + change) over the lineage
    is the change of the last champion against the bootstrap. None without such a lineage
    or when a step lacks one of its arms.
    """
    nxt: dict[str, tuple[str, Cohort, Cohort]] = {}
    for stable, cand, st, ca in steps:
        nxt.setdefault(stable, (cand, st, ca))
    versions, dp, dl, cur = [baseline], 1.0, 1.0, baseline
    while cur != final and cur in nxt and len(versions) <= len(steps):
        cand, st, ca = nxt[cur]
        dp *= 1 + relative_change(st.edit_persistence, ca.edit_persistence)
        dl *= 1 + relative_change(st.latency_ms, ca.latency_ms)
        versions.append(cand)
        cur = cand
    if cur != final or len(versions) < 2 or math.isnan(dp) or math.isnan(dl):
        return None  # no lineage, or a step without both arms measured
    return Chain(tuple(versions), dp - 1, dl - 1, dp - 1 >= targets.persistence_up,
                 dl - 1 <= -targets.latency_down)


def side_by_side(rows: Sequence[Row], stable: str, candidate: str, start: float, end: float,
                 ) -> tuple[Cohort, Cohort]:
    """Both arms over the same window (a canary's life): stable ``stable`` vs ``candidate``."""
    inside = [r for r in rows if start <= r.served_ts <= end]
    return (cohort([r for r in inside if r.version == stable]),
            cohort([r for r in inside if r.version == candidate]))


# --------------------------------------------------------------------------- ledger entries


@dataclass(frozen=True)
class Decision:
    """One canary from the ledger (the deployments experiment in MLflow)."""

    canary_id: str
    candidate: str
    stable: str
    outcome: str
    reason: str
    decided_by: str
    decided_at: str
    started_at: float
    kind: str = ""
    """What the candidate version was (rtrl.kind tag): increment, bootstrap, or an injected one."""
    url: str = ""
    evidence: dict[str, float] = field(default_factory=dict)
    """Last value of each cohort.* and judge.* metric."""


def _pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:+.1%}"


def _num(x: float, fmt: str = ".3f") -> str:
    return "n/a" if isinstance(x, float) and math.isnan(x) else format(x, fmt)


def render_markdown(
    *,
    title: str,
    command: str,
    started: float,
    finished: float,
    cohorts: Mapping[str, Cohort],
    comparison: Comparison | None,
    decisions: Sequence[Decision],
    bad_version: str | None,
    mlflow_url: str,
    plots: Sequence[str],
    notes: Sequence[str] = (),
    kinds: Mapping[str, str] | None = None,
    concurrent: Sequence[tuple[Decision, Cohort, Cohort]] = (),
    chain: Chain | None = None,
) -> str:
    kinds = kinds or {}
    when = datetime.fromtimestamp(started, UTC).strftime("%Y-%m-%d %H:%M UTC")
    minutes = (finished - started) / 60
    lines = [f"# {title}", "", f"Run {when}, {minutes:.1f} minutes. Command: `{command}`", ""]
    lines += ["All figures below are measured from the reward records on the rewards topic (one per "
              "served completion, with the version and arm that served it), i.e. from live "
              "cohorts through the canary, not from training logs.", ""]
    lines += ["## Result", ""]
    if comparison is None:
        lines += ["No champion was promoted in this run, so there is no before/after comparison.", ""]
    else:
        b, f = cohorts[comparison.baseline], cohorts[comparison.final]
        ok = {True: "met", False: "**not met**"}
        lineage = " → ".join(f"v{v}" for v in chain.versions) if chain else ""
        cp = _pct(chain.persistence_change) if chain else "n/a"
        cl = _pct(chain.latency_change) if chain else "n/a"
        p_ok = chain.persistence_ok if chain else comparison.persistence_ok
        l_ok = chain.latency_ok if chain else comparison.latency_ok
        lines += [
            f"| | bootstrap champion v{comparison.baseline} | last promoted champion "
            f"v{comparison.final} | change, whole run | change side by side{', ' + lineage if chain else ''} "
            "| target |",
            "|---|---|---|---|---|---|",
            f"| edit persistence | {_num(b.edit_persistence)} | {_num(f.edit_persistence)} | "
            f"{_pct(comparison.persistence_change)} | {cp} | ≥ +10%: {ok[p_ok]} |",
            f"| mean latency (ms) | {_num(b.latency_ms, '.1f')} | {_num(f.latency_ms, '.1f')} | "
            f"{_pct(comparison.latency_change)} | {cl} | ≤ −10%: {ok[l_ok]} |",
            f"| reward | {_num(b.reward)} | {_num(f.reward)} | "
            f"{_pct(relative_change(b.reward, f.reward))} | | |",
            f"| acceptance | {_num(b.acceptance)} | {_num(f.acceptance)} | "
            f"{_pct(relative_change(b.acceptance, f.acceptance))} | | |",
            f"| completions measured | {b.n} | {f.n} | | | |",
            "",
            "*Whole run* compares everything each version served, at different minutes of the run. "
            "*Side by side* compounds each promotion's canary, where both arms served the same "
            "minutes on the same machine: (1 + change) multiplied over the lineage. Latency includes "
            "the real generation time, which moves with the machine's load, so the targets are judged "
            "on the side-by-side figures" + ("" if chain else " (none here: judged on the whole run)")
            + ".",
            "",
        ]
    if concurrent:
        lines += ["Each promotion measured side by side during its canary (same time window, same "
                  "load; stable arm vs canary arm):", "",
                  "| promotion | n stable / canary | edit persistence | mean latency ms | reward |",
                  "|---|---|---|---|---|"]
        for d, st, ca in concurrent:
            dp = _pct(relative_change(st.edit_persistence, ca.edit_persistence))
            lines.append(
                f"| v{d.stable} → v{d.candidate} | {st.n} / {ca.n} | {_num(st.edit_persistence)} → "
                f"{_num(ca.edit_persistence)} ({dp}) | "
                f"{_num(st.latency_ms, '.1f')} → {_num(ca.latency_ms, '.1f')} "
                f"({_pct(relative_change(st.latency_ms, ca.latency_ms))}) | "
                f"{_num(st.reward)} → {_num(ca.reward)} |")
        lines.append("")
    if bad_version:
        bad = [d for d in decisions if d.candidate == bad_version]
        if bad and bad[0].outcome == "rolled_back" and bad[0].decided_by == "controller":
            lines += [f"The deliberately bad candidate v{bad_version} ({kinds.get(bad_version, '?')}) "
                      f"was **rolled back automatically**: {bad[0].reason}", ""]
        elif bad:
            lines += [f"The deliberately bad candidate v{bad_version} ended as **{bad[0].outcome}** "
                      f"(decided by {bad[0].decided_by}): {bad[0].reason}", ""]
        else:
            lines += [f"The deliberately bad candidate v{bad_version} has no decision in the ledger "
                      "(the run ended before its canary was decided).", ""]
    lines += [f"MLflow (registry, training runs, decision ledger): {mlflow_url}", ""]
    lines += ["## Canary decisions (the ledger)", ""]
    if decisions:
        lines += ["| canary | candidate | stable | outcome | decided by | decided at | reason | evidence |",
                  "|---|---|---|---|---|---|---|---|"]
        for d in decisions:
            ev = ", ".join(f"{k} {v:.3g}" for k, v in sorted(d.evidence.items())
                           if k.startswith("cohort.") and k.split(".")[-1] in {
                               "edit_persistence", "persistence", "reward", "latency_mean",
                               "latency_ms", "edit_rate", "n"})
            link = f"[{d.canary_id}]({d.url})" if d.url else d.canary_id
            kind = f" ({d.kind})" if d.kind else ""
            reason = d.reason.replace("|", "/").replace("\n", " ")
            lines.append(f"| {link} | v{d.candidate}{kind} | v{d.stable} | {d.outcome} | "
                         f"{d.decided_by} | {d.decided_at} | {reason} | {ev or 'see run'} |")
        lines.append("")
    else:
        lines += ["No canary was decided in this run.", ""]
    lines += ["## Per served version", "",
              "| version | kind | completions | edit persistence | acceptance | mean latency ms | "
              "p95 latency ms | reward | edit rate | questions | dissatisfied |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for v, c in cohorts.items():
        lines.append(
            f"| v{v} | {kinds.get(v, '')} | {c.n} | {_num(c.edit_persistence)} | {_num(c.acceptance)} | "
            f"{_num(c.latency_ms, '.1f')} | {_num(c.latency_p95_ms, '.1f')} | {_num(c.reward)} | "
            f"{_num(c.edit_rate, '.2f')} | {_num(c.question_rate, '.2f')} | "
            f"{_num(c.dissatisfied_rate, '.2f')} |")
    lines.append("")
    if plots:
        lines += ["## Over time", "",
                  "Solid lines: stable arm; dashed: canary arm. Vertical lines: decisions.", ""]
        lines += [f"![{p}]({p})" for p in plots]
        lines.append("")
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(lines)


# --------------------------------------------------------------------------- plots


METRIC_LABELS = {
    "edit_persistence": "edit persistence (primary horizon, accepted edits)",
    "latency_ms": "mean latency (ms)",
    "reward": "mean reward",
}


def plot_metric(rows: Sequence[Row], t0: float, metric: str, path: Path,
                decisions: Sequence[Decision] = (), bin_s: float = 20.0) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    colours: dict[str, Any] = {}
    cmap = plt.get_cmap("tab10")
    for (version, arm), pts in series(rows, t0, bin_s, metric).items():
        colour = colours.setdefault(version, cmap(len(colours) % 10))
        xs, ys = zip(*pts, strict=True)
        label = f"v{version} {arm}"
        ax.plot(xs, ys, linestyle="-" if arm == "stable" else "--", marker=".", color=colour, label=label)
    for d in decisions:
        try:
            x = (_ts(d.decided_at) - t0) / 60.0
        except ValueError:
            continue
        ax.axvline(x, color="green" if d.outcome == "promoted" else "red", alpha=0.4, linewidth=1)
        ax.annotate(f"v{d.candidate} {d.outcome}", (x, 1.0), xycoords=("data", "axes fraction"),
                    rotation=90, va="top", ha="right", fontsize=7)
    ax.set_xlabel("minutes since the loop started")
    ax.set_ylabel(METRIC_LABELS.get(metric, metric))
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --------------------------------------------------------------------------- I/O adapters


def read_rewards(settings: Any) -> list[dict[str, Any]]:
    """Every reward record on the rewards topic, from the beginning (read_committed); records
    that are not JSON are skipped."""
    from services.runtime.kafka_io import read_topic

    out: list[dict[str, Any]] = []
    for rec in read_topic(settings.kafka, settings.topics.rewards):
        try:
            out.append(json.loads(rec.value))
        except (TypeError, ValueError):
            continue
    return out


def read_ledger(tracking_uri: str, experiment: str) -> list[Decision]:
    """The decided canaries of the deployments experiment, oldest first."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    out = []
    runs = client.search_runs([exp.experiment_id], max_results=500,
                              order_by=["attributes.start_time ASC"])
    for run in runs:
        tags = run.data.tags
        outcome = tags.get("rtrl.canary.outcome", "")
        if outcome in {"", "running"}:
            continue
        out.append(Decision(
            canary_id=tags.get("rtrl.canary.id", run.info.run_name or run.info.run_id),
            candidate=tags.get("rtrl.candidate_version", ""),
            stable=tags.get("rtrl.stable_version", ""),
            outcome=outcome,
            reason=tags.get("rtrl.decision.reason", ""),
            decided_by=tags.get("rtrl.decided_by", ""),
            decided_at=tags.get("rtrl.decided_at", ""),
            started_at=run.info.start_time / 1000.0,
            url=f"{tracking_uri.rstrip('/')}/#/experiments/{exp.experiment_id}/runs/{run.info.run_id}"
            if tracking_uri.startswith("http") else "",
            evidence={k: float(v) for k, v in run.data.metrics.items()},
        ))
    return out


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
) -> Path:
    """Write report.md, the plots and summary.json into ``report_dir``; return report.md."""
    report_dir.mkdir(parents=True, exist_ok=True)
    rows = [row_from_record(r, primary_horizon_s) for r in records]
    cohorts = by_version(rows)
    comparison = None
    if baseline_version and final_version and baseline_version != final_version \
            and baseline_version in cohorts and final_version in cohorts:
        comparison = compare(cohorts, baseline_version, final_version)
    t0 = min((r.served_ts for r in rows), default=started)
    plots = []
    for metric in ("edit_persistence", "latency_ms", "reward"):
        name = f"{metric}.png"
        plot_metric(rows, t0, metric, report_dir / name, decisions)
        plots.append(name)
    concurrent = []
    for d in decisions:
        if d.outcome != "promoted":
            continue
        try:
            end = _ts(d.decided_at)
        except ValueError:
            continue
        st, ca = side_by_side(rows, d.stable, d.candidate, d.started_at, end)
        concurrent.append((d, st, ca))
    chain = None
    if comparison is not None:
        chain = chain_comparison([(d.stable, d.candidate, st, ca) for d, st, ca in concurrent],
                                 comparison.baseline, comparison.final)
    md = render_markdown(
        title="rtrl closed-loop demo", command=command, started=started, finished=finished,
        cohorts=cohorts, comparison=comparison, decisions=decisions, bad_version=bad_version,
        mlflow_url=mlflow_url, plots=plots, notes=notes, kinds=kinds, concurrent=concurrent,
        chain=chain,
    )
    path = report_dir / "report.md"
    path.write_text(md)
    summary = {
        "cohorts": {v: asdict(c) for v, c in cohorts.items()},
        "comparison": asdict(comparison) if comparison else None,
        "chain": asdict(chain) if chain else None,
        "decisions": [asdict(d) for d in decisions],
        "side_by_side": [{"stable": d.stable, "candidate": d.candidate, "stable_cohort": asdict(st),
                          "canary_cohort": asdict(ca)} for d, st, ca in concurrent],
        "bad_version": bad_version,
        "kinds": dict(kinds or {}),
        "records": len(rows),
    }
    with open(report_dir / "rewards.jsonl", "w") as fh:  # the raw evidence, to recompute anything
        fh.writelines(json.dumps(r, default=str) + "\n" for r in records)
    (report_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str, allow_nan=True))
    return path
