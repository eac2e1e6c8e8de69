"""The demo report's text: ``render_markdown`` is its sections in order, one function each."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime

from services.report.cohorts import Chain, Cohort, Comparison, relative_change
from services.report.sources import Decision

LEDGER_EVIDENCE = {"edit_persistence", "persistence", "reward", "latency_mean", "latency_ms", "edit_rate",
                   "n"}
"""The cohort.* metrics of a ledger run shown in the decisions table."""


def _pct(x: float | None) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{x:+.1%}"


def _num(x: float | None, fmt: str = ".3f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


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
    bad_versions: Sequence[str] = (),
    mlflow_url: str,
    plots: Sequence[str],
    notes: Sequence[str] = (),
    kinds: Mapping[str, str] | None = None,
    concurrent: Sequence[tuple[Decision, Cohort, Cohort]] = (),
    chain: Chain | None = None,
    holdout: Sequence[str] = (),
    horizon_s: int | None = None,
) -> str:
    kinds = kinds or {}
    lines = [
        *heading(title, command, started, finished, horizon_s),
        "## Result", "",
        *result_table(cohorts, comparison, chain),
        *promotions_side_by_side(concurrent),
        *holdout,
        *(line for v in (bad_versions or ([bad_version] if bad_version else []))
          for line in bad_candidate_outcome(v, decisions, kinds)),
        f"MLflow (registry, training runs, decision ledger): {mlflow_url}", "",
        *decisions_section(decisions),
        *versions_section(cohorts, kinds),
        *plots_section(plots),
        *notes_section(notes),
    ]
    return "\n".join(lines)


def heading(title: str, command: str, started: float, finished: float, horizon_s: int | None = None,
            ) -> list[str]:
    when = datetime.fromtimestamp(started, UTC).strftime("%Y-%m-%d %H:%M UTC")
    minutes = (finished - started) / 60
    return [f"# {title}", "", f"Run {when}, {minutes:.1f} minutes. Command: `{command}`", "",
            "All figures below are measured from the reward records on the rewards topic (one per "
            "served completion, with the version and arm that served it), i.e. from live "
            "cohorts through the canary, not from training logs.", "",
            *([f"Edit persistence is the share of an accepted edit still in the file {horizon_s} s after "
               "it: the reward spec's primary horizon, the one the judge decides on (the nearest "
               "reported horizon when that one is missing).", ""] if horizon_s is not None else [])]


def result_table(cohorts: Mapping[str, Cohort], comparison: Comparison | None,
                 chain: Chain | None) -> list[str]:
    """The bootstrap champion against the last promoted one, whole run and side by side."""
    if comparison is None:
        return ["No champion was promoted in this run, so there is no before/after comparison.", ""]
    b, f = cohorts[comparison.baseline], cohorts[comparison.final]
    ok = {True: "met", False: "**not met**"}
    lineage = " → ".join(f"v{v}" for v in chain.versions) if chain else ""
    cp = _pct(chain.persistence_change) if chain else "n/a"
    cl = _pct(chain.latency_change) if chain else "n/a"
    cd = _pct(chain.dissatisfied_change) if chain else "n/a"
    p_ok = chain.persistence_ok if chain else comparison.persistence_ok
    l_ok = chain.latency_ok if chain else comparison.latency_ok
    d_ok = chain.dissatisfied_ok if chain else comparison.dissatisfied_ok
    return [
        f"| | bootstrap champion v{comparison.baseline} | last promoted champion "
        f"v{comparison.final} | change, whole run | change side by side{', ' + lineage if chain else ''} "
        "| target |",
        "|---|---|---|---|---|---|",
        f"| edit persistence | {_num(b.edit_persistence)} | {_num(f.edit_persistence)} | "
        f"{_pct(comparison.persistence_change)} | {cp} | ≥ +10%: {ok[p_ok]} |",
        f"| mean latency (ms) | {_num(b.latency_ms, '.1f')} | {_num(f.latency_ms, '.1f')} | "
        f"{_pct(comparison.latency_change)} | {cl} | ≤ −10%: {ok[l_ok]} |",
        f"| dissatisfied follow-ups | {_num(b.dissatisfied_rate)} | {_num(f.dissatisfied_rate)} | "
        f"{_pct(comparison.dissatisfied_change)} | {cd} | no worse: {ok[d_ok]} |",
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


def promotions_side_by_side(concurrent: Sequence[tuple[Decision, Cohort, Cohort]]) -> list[str]:
    """One row per promotion: its stable and canary arms over the canary's own minutes."""
    if not concurrent:
        return []
    lines = ["Each promotion measured side by side during its canary (same time window, same "
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
    return lines


def bad_candidate_outcome(bad_version: str | None, decisions: Sequence[Decision],
                          kinds: Mapping[str, str]) -> list[str]:
    """What became of the deliberately bad candidate (nothing when none was injected)."""
    if not bad_version:
        return []
    bad = [d for d in decisions if d.candidate == bad_version]
    if bad and bad[0].outcome == "rolled_back" and bad[0].decided_by == "controller":
        return [f"The deliberately bad candidate v{bad_version} ({kinds.get(bad_version, '?')}) "
                f"was **rolled back automatically**: {bad[0].reason}", ""]
    if bad:
        return [f"The deliberately bad candidate v{bad_version} ended as **{bad[0].outcome}** "
                f"(decided by {bad[0].decided_by}): {bad[0].reason}", ""]
    return [f"The deliberately bad candidate v{bad_version} has no decision in the ledger "
            "(the run ended before its canary was decided).", ""]


def decisions_section(decisions: Sequence[Decision]) -> list[str]:
    """The ledger: one row per decided canary, linked to its MLflow run."""
    lines = ["## Canary decisions (the ledger)", ""]
    if not decisions:
        return [*lines, "No canary was decided in this run.", ""]
    lines += ["| canary | candidate | stable | outcome | decided by | decided at | reason | evidence |",
              "|---|---|---|---|---|---|---|---|"]
    lines += [decision_row(d) for d in decisions]
    lines.append("")
    return lines


def decision_row(d: Decision) -> str:
    ev = ", ".join(f"{k} {v:.3g}" for k, v in sorted(d.evidence.items())
                   if k.startswith("cohort.") and k.split(".")[-1] in LEDGER_EVIDENCE)
    link = f"[{d.canary_id}]({d.url})" if d.url else d.canary_id
    kind = f" ({d.kind})" if d.kind else ""
    reason = d.reason.replace("|", "/").replace("\n", " ")
    return (f"| {link} | v{d.candidate}{kind} | v{d.stable} | {d.outcome} | "
            f"{d.decided_by} | {d.decided_at} | {reason} | {ev or 'see run'} |")


def versions_section(cohorts: Mapping[str, Cohort], kinds: Mapping[str, str]) -> list[str]:
    """Every served version's cohort over the whole run."""
    lines = ["## Per served version", "",
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
    return lines


def plots_section(plots: Sequence[str]) -> list[str]:
    if not plots:
        return []
    return ["## Over time", "",
            "Solid lines: stable arm; dashed: canary arm. Vertical lines: decisions.", "",
            *[f"![{p}]({p})" for p in plots], ""]


def notes_section(notes: Sequence[str]) -> list[str]:
    if not notes:
        return []
    return ["## Notes", "", *[f"- {n}" for n in notes], ""]
