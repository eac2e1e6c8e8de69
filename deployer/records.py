"""What a product reviewer reads in MLflow (pure): each model version's description and fate,
each ledger run's description and its stable-vs-canary comparison table.

MLflow renders descriptions as markdown, so they carry links both ways (version ↔ ledger run
↔ training run) as fragment URLs of the MLflow UI (``#/models/<name>/versions/<v>``,
``#/experiments/<id>/runs/<run>``), which resolve against whatever address the UI is served
from. The adapters (deployer/adapters/mlflow_registry.py, ledger_mlflow.py) write them.

A version's description is rebuilt from its tags whenever the deployer tags it, so it follows
its fate: ``never_offered`` (registered, no canary yet, or never: a failed gate), ``canary``
(under canary), ``promoted`` (became the champion), ``superseded`` (a champion replaced by a
newer promotion) or ``rolled_back`` (its canary was rolled back or aborted, or, as a champion,
it was rolled back by hand).
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ingest.contracts.registry import (
    CHAMPION_SINCE,
    CHAMPION_SUCCESSOR,
    CHAMPION_UNTIL,
    FATE,
    TAG_CANARY_ID,
    TAG_CANDIDATE,
    TAG_KIND,
    TAG_STABLE,
    Tag,
)
from rollback.metrics import fmt_delta, fmt_value

NEVER_OFFERED, CANARY, PROMOTED, SUPERSEDED, ROLLED_BACK = (
    "never_offered", "canary", "promoted", "superseded", "rolled_back")
FATES = (PROMOTED, ROLLED_BACK, SUPERSEDED, NEVER_OFFERED, CANARY)
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}
"""MLflow 3's UI reads this experiment tag to show an experiment as machine learning (runs)
rather than GenAI (traces). MLflow 3.17's UI, with its GenAI / Model training switch, follows
the switch instead (``?workflowType=`` or the browser's last choice), so run links also say
which view to open (``RUN_VIEW``)."""
LEDGER_EXPERIMENT_NOTE = (
    "**rtrl deployment ledger.** One run per canary: its description opens with the verdict and "
    "the judge's reasons, its metrics are the evidence judged at each tick, `comparison.csv` holds "
    "the final figures per metric, and its tags name the candidate, the stable version and who "
    "decided. Each model version of the registered model links to its canary's run here.\n\n"
    "Open the runs in the **Model training** view (the GenAI view shows traces, which rtrl does "
    "not log).")
TRAINING_EXPERIMENT_NOTE = (
    "**rtrl training.** One run per RL increment (`increment-<window id>`) and per bootstrap: "
    "its parameters, the metrics of each step, the parent version and data window "
    "(`rtrl.parent_version`, `rtrl.window`), the offline gate against the parent, and "
    "`rtrl.outcome` (success, skipped, failed, or interrupted: its trainer stopped before it "
    "finished, and a later run trained the window again). Each model version links to the run "
    "that made it.\n\nOpen the runs in the **Model training** view (the GenAI view shows traces, "
    "which rtrl does not log).")
RUN_VIEW = "?workflowType=machine_learning"
"""Opens a run link in MLflow 3.17's "Model training" view, whatever the browser chose last."""

FATE_LINE = {
    NEVER_OFFERED: "not offered to users",
    CANARY: "under canary",
    PROMOTED: "champion",
    SUPERSEDED: "former champion, superseded",
    ROLLED_BACK: "rolled back",
}


def run_link(experiment_id: str, run_id: str) -> str:
    return f"#/experiments/{experiment_id}/runs/{run_id}{RUN_VIEW}"


def version_link(model: str, version: str) -> str:
    return f"#/models/{model}/versions/{version}"


def fate_of_outcome(outcome: str) -> str:
    """A decided canary's candidate: promoted, or rolled back (aborted ones too: they served
    users and were taken off)."""
    return PROMOTED if outcome == "promoted" else ROLLED_BACK


def window_words(raw: str) -> str:
    """A ``rtrl.window`` tag in words: topic, offsets per partition, records."""
    try:
        w = json.loads(raw)
        parts = ", ".join(f"p{r['partition']} {r['start']}–{r['end']}" for r in w.get("ranges", []))
        return f"`{w['topic']}` offsets {parts or '(none)'}; {w.get('records', '?')} records"
    except (ValueError, KeyError, TypeError):
        return raw


def _gate(tags: Mapping[str, str]) -> str:
    result = tags.get(Tag.GATE_RESULT, "")
    if not result:
        return "not run"
    try:
        reasons = json.loads(tags.get(Tag.GATE_REASONS, "{}")).get("reasons", [])
    except (ValueError, AttributeError):
        reasons = []
    return f"**{result}**" + (": " + "; ".join(map(str, reasons)) if reasons else "")


def version_description(model: str, version: str, tags: Mapping[str, str], training_run: str | None = None,
                        ledger_run: str | None = None) -> str:
    """Markdown for a model version: what it is, where it came from, what became of it.
    ``training_run`` / ``ledger_run`` are UI links (``#/experiments/...``) when known."""
    fate = tags.get(FATE, NEVER_OFFERED)
    head = f"rtrl policy v{version}: {FATE_LINE.get(fate, fate)}"  # plain: lists show it raw
    parent = tags.get(Tag.PARENT_VERSION, "")
    made = tags.get(Tag.KIND, "policy")
    rows = [("what", f"{made}" + (f", trained from [v{parent}]({version_link(model, parent)})" if parent
                                   else " (no parent)"))]
    if tags.get(Tag.WINDOW):
        rows.append(("data window", window_words(tags[Tag.WINDOW])))
    rows.append(("reward spec", tags.get(Tag.REWARD_SPEC_VERSION) or "unknown"))
    if training_run:
        rows.append(("training run", f"[{tags.get(Tag.RUN_ID, 'run')}]({training_run})"))
    rows.append(("offline gate", _gate(tags)))
    cid = tags.get(TAG_CANARY_ID)
    if cid:
        name = f"[{cid}]({ledger_run})" if ledger_run else cid
        outcome = tags.get(Tag.CANARY_OUTCOME, "")
        rows.append(("canary", f"{name}: {outcome or 'running'}"))
    verdict, reasons = verdict_and_reasons(tags)
    if tags.get(Tag.DECISION):
        rows.append(("decision", f"{tags[Tag.DECISION]} by {tags.get(Tag.DECIDED_BY, '?')} at "
                                 f"{tags.get('rtrl.decided_at', '?')}: {verdict}"))
    if tags.get(CHAMPION_SINCE) or tags.get(CHAMPION_UNTIL):
        rows.append(("champion", _reign(model, fate, tags)))
    rows.append(("fate", f"`{fate}`"))
    table = "\n".join(f"| {k} | {_cell(v)} |" for k, v in rows)
    why = "".join(f"\n- {r}" for r in reasons)
    return f"{head}\n\n| | |\n|---|---|\n{table}\n" + (f"\nThe judge's reasons:\n{why}\n" if why else "")


def verdict_and_reasons(tags: Mapping[str, str]) -> tuple[str, list[str]]:
    """A decision's one-line verdict and the judge's reasons behind it, one per metric: the
    reason tag ends with those reasons joined, and the verdict is what comes before them. A
    reason the judge did not give (an operator's, an error's) is the verdict alone."""
    reason = tags.get(Tag.DECISION_REASON, "")
    try:
        reasons = [str(r) for r in json.loads(tags.get(Tag.DECISION_REASONS, "[]"))]
    except (ValueError, TypeError):
        reasons = []
    joined = "; ".join(reasons)
    if not reasons or not reason.endswith(joined):
        return reason, []
    return reason[: len(reason) - len(joined)].rstrip(": ") or reason, reasons


INDEX_ROWS = 40
"""Versions listed in the registered model's description (newest first); the rest are on
MLflow's versions tab."""


def model_index(model: str, champion: str | None, versions: Sequence[tuple[str, Mapping[str, str]]],
                ledger_links: Mapping[str, str]) -> str:
    """Markdown for the registered model: the champion now, then one row per version (newest
    first): its fate, the decision on it, when and by whom, and a link to its canary's ledger
    run (``ledger_links``: canary id -> run link)."""
    now = f"[v{champion}]({version_link(model, champion)})" if champion else "none yet"
    lines = [f"rtrl policies. Champion now: {now}. Each version's page says what it was trained "
             "from and why it was decided; each canary's ledger run holds the evidence.", "",
             "| version | fate | decision | when | by | canary |", "|---|---|---|---|---|---|"]
    newest = sorted(versions, key=lambda v: int(v[0]) if v[0].isdigit() else -1, reverse=True)
    for version, tags in newest[:INDEX_ROWS]:
        fate = tags.get(FATE, NEVER_OFFERED)
        cid = tags.get(TAG_CANARY_ID, "")
        canary = f"[{cid}]({ledger_links[cid]})" if cid in ledger_links else cid or "–"
        shown = FATE_LINE[PROMOTED] if version == champion else FATE_LINE.get(fate, fate)
        cells = [f"[v{version}]({version_link(model, version)})", shown,
                 tags.get(Tag.DECISION) or "–", tags.get("rtrl.decided_at") or "–",
                 tags.get(Tag.DECIDED_BY) or "–", canary]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    if len(newest) > INDEX_ROWS:
        lines += ["", f"{len(newest) - INDEX_ROWS} older versions: MLflow's versions tab."]
    return "\n".join(lines) + "\n"


def _reign(model: str, fate: str, tags: Mapping[str, str]) -> str:
    """"since …", and for a version no longer champion "until … (superseded by v7)" (a first
    champion, set by ``rtrl bootstrap``, has no "since")."""
    since = tags.get(CHAMPION_SINCE)
    until, successor = tags.get(CHAMPION_UNTIL), tags.get(CHAMPION_SUCCESSOR)
    out = " ".join(part for part in (since and f"since {since}", until and f"until {until}") if part)
    if until and successor:
        how = "superseded by" if fate == SUPERSEDED else "replaced by"
        out += f" ({how} [v{successor}]({version_link(model, successor)}))"
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# ----------------------------------------------------------------------------- ledger run
@dataclass(frozen=True)
class Row:
    """One line of the comparison: a judged metric (with the always-valid interval on
    canary − stable and its p-value) or a plain cohort figure (delta only)."""

    metric: str
    source: str
    """judge | cohort"""
    stable: float | None
    canary: float | None
    delta: float | None
    ci_lower: float | None = None
    ci_upper: float | None = None
    p_value: float | None = None


JUDGE_STATS = ("stable_mean", "canary_mean", "estimate", "ci_lower", "ci_upper", "p_value")


def comparison(metrics: Mapping[str, float]) -> list[Row]:
    """Rows from a ledger run's latest metrics: ``judge.<m>.<stat>`` then ``cohort.<arm>.<f>``."""
    rows: list[Row] = []
    judged = sorted({k.split(".")[1] for k in metrics
                     if k.startswith("judge.") and k.count(".") == 2 and k.endswith(".estimate")})
    for m in judged:
        g = {s: metrics.get(f"judge.{m}.{s}") for s in JUDGE_STATS}
        rows.append(Row(m, "judge", g["stable_mean"], g["canary_mean"], g["estimate"], g["ci_lower"],
                        g["ci_upper"], g["p_value"]))
    arms = ("cohort.stable.", "cohort.canary.")
    figures = sorted({k.split(".", 2)[2] for k in metrics if k.startswith(arms)})
    for f in figures:
        s, c = metrics.get(f"cohort.stable.{f}"), metrics.get(f"cohort.canary.{f}")
        rows.append(Row(f, "cohort", s, c, None if s is None or c is None else c - s))
    return rows


def comparison_csv(rows: list[Row]) -> str:
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(["metric", "source", "stable", "canary", "delta", "ci_lower", "ci_upper", "p_value"])
    for r in rows:
        w.writerow([r.metric, r.source, *("" if v is None else f"{v:.6g}" for v in
                                          (r.stable, r.canary, r.delta, r.ci_lower, r.ci_upper, r.p_value))])
    return out.getvalue()


def _num(v: float | None) -> str:
    return "–" if v is None else f"{v:.4g}"


def metric_line(r: Row) -> str:
    """``persistence: stable 80.1%, canary 50.7%, delta -29.3 pts, always-valid interval
    [-33.1 pts, -25.6 pts], p 8e-06``: in the units of the judge's reasons (rates in % and
    points, latency in ms; others as numbers)."""
    def value(v: float | None) -> str:
        return "–" if v is None else fmt_value(r.metric, v)

    def delta(v: float | None) -> str:
        return "–" if v is None else fmt_delta(r.metric, v)

    text = f"{r.metric}: stable {value(r.stable)}, canary {value(r.canary)}, delta {delta(r.delta)}"
    if r.ci_lower is not None or r.ci_upper is not None:
        text += f", always-valid interval [{delta(r.ci_lower)}, {delta(r.ci_upper)}]"
    if r.p_value is not None:
        text += f", p {_num(r.p_value)}"
    return text


DECISION_WORDS = {
    "promoted": "v{c} was promoted: it is the champion now, in place of v{s}.",
    "rolled_back": "v{c} was rolled back: v{s} stays the champion.",
    "aborted": "The canary of v{c} was aborted without a decision on quality: v{s} stays the champion.",
}
RUNNING_WORDS = "The canary of v{c} against v{s} is running."
RESTORE_WORDS = "The champion v{s} was rolled back by hand to v{c}."


TITLE_WORDS = {"promoted": "promoted", "rolled_back": "rolled back", "aborted": "aborted"}


def run_title(tags: Mapping[str, str]) -> str:
    """A decided ledger run's name in MLflow's run list: the candidate, its outcome and who
    decided (``v7 rolled back by controller``); a hand restore names both versions."""
    cand, stable = tags.get(TAG_CANDIDATE, "?"), tags.get(TAG_STABLE) or "?"
    by = tags.get(Tag.DECIDED_BY, "?")
    if tags.get(TAG_KIND) == "manual_rollback":
        return f"v{stable} rolled back to v{cand} by {by}"
    outcome = tags.get(Tag.CANARY_OUTCOME, "")
    return f"v{cand} {TITLE_WORDS.get(outcome, outcome or 'decided')} by {by}"


def run_description(tags: Mapping[str, str], rows: list[Row], model: str,
                    training_run: str | None = None) -> str:
    """Markdown for a ledger run: the decision in plain words, links, one line per metric."""
    cand, stable = tags.get(TAG_CANDIDATE, "?"), tags.get(TAG_STABLE) or "-"
    outcome = tags.get(Tag.CANARY_OUTCOME, "running")
    if tags.get(TAG_KIND) == "manual_rollback":
        words = RESTORE_WORDS.format(c=cand, s=stable)
    else:
        words = DECISION_WORDS.get(outcome, RUNNING_WORDS).format(c=cand, s=stable)
    lines = [words, ""]  # plain: MLflow's run list shows a description's start raw
    if tags.get(Tag.DECISION):
        verdict, reasons = verdict_and_reasons(tags)
        lines += [f"Decided by {tags.get(Tag.DECIDED_BY, '?')} at {tags.get('rtrl.decided_at', '?')}: "
                  f"{verdict.rstrip('.')}.", ""]
        lines += [*(f"- {r}" for r in reasons), ""] if reasons else []
    links = [f"candidate [v{cand}]({version_link(model, cand)})"]
    if stable != "-":
        links.append(f"stable [v{stable}]({version_link(model, stable)})")
    if training_run:
        links.append(f"[training run]({training_run})")
    lines += ["; ".join(links) + ". Every figure: the `comparison.csv` artifact.", ""]
    judged = [r for r in rows if r.source == "judge"]
    if judged:
        lines += ["Judged metrics at the decision (canary − stable):", ""]
        lines += [f"- {metric_line(r)}" for r in judged]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
