"""What the decision ledger records (pure content; deployer/adapters/ledger_mlflow.py writes it).

One MLflow run per canary, named after the canary id (``canary-v7-20261122T031500Z``) in the
deployments experiment. A product reviewer answers from it alone:

- what shipped when: tags ``rtrl.decision`` / ``rtrl.canary.outcome`` and the run's end time;
- on what evidence: step metrics ``cohort.<arm>.<metric>`` and ``judge.<metric>.<stat>`` at
  every judged tick, ``canary.weight`` over time, and the ``cohorts.png`` plot;
- what was rolled back and why: ``rtrl.decision.reason`` and ``rtrl.decided_by``
  (``controller`` or the operator's name), mirrored on the model version's tags.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime

from ingest.contracts.registry import (
    OUTCOME_RUNNING,
    TAG_CANARY_ID,
    TAG_CANDIDATE,
    TAG_CLAIMED_BY,
    TAG_DECIDED_AT,
    TAG_KIND,
    TAG_STABLE,
    Tag,
)

TAG_GATE = Tag.GATE_RESULT
TAG_OUTCOME = Tag.CANARY_OUTCOME
TAG_DECISION = Tag.DECISION
TAG_REASON = Tag.DECISION_REASON
TAG_DECIDED_BY = Tag.DECIDED_BY

CONTROLLER = "controller"
"""``decided_by`` for decisions the controller took by itself."""


OUTCOMES = ("promoted", "rolled_back", "aborted")
"""Final outcomes; the decision tag says promote / rollback / abort respectively."""
DECISION_OF = {"promoted": "promote", "rolled_back": "rollback", "aborted": "abort"}

VERDICT_CODE = {"rollback": -1.0, "continue": 0.0, "inconclusive": 0.5, "promote": 1.0}
"""The judge's verdict as a step metric (``judge.verdict``) so it can be plotted."""

MAX_TAG_CHARS = 4_900
"""MLflow caps tag values at 5,000 characters (sqlite store); longer reasons are cut."""


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def canary_id(kind: str, version: str, ts: float) -> str:
    """Run name and ledger key: e.g. ``canary-v7-20261122T031500Z``, ``promote-v7-...``."""
    stamp = datetime.fromtimestamp(ts, UTC).strftime("%Y%m%dT%H%M%SZ")
    return f"{kind}-v{version}-{stamp}"


def clip(text: str) -> str:
    return text if len(text) <= MAX_TAG_CHARS else text[: MAX_TAG_CHARS - 3] + "..."


LINEAGE = (Tag.PARENT_VERSION, Tag.WINDOW, Tag.REWARD_SPEC_VERSION, Tag.KIND, Tag.RUN_ID)
"""Version tags copied onto the ledger run as ``rtrl.candidate.<name>``: which data, which
reward definition and which training run made the candidate."""


def lineage_tags(version_tags: Mapping[str, str]) -> dict[str, str]:
    """The candidate's lineage, renamed ``rtrl.x`` -> ``rtrl.candidate.x``."""
    return {f"rtrl.candidate.{k.removeprefix('rtrl.')}": clip(str(version_tags[k]))
            for k in LINEAGE if version_tags.get(k) not in (None, "")}


def open_tags(cid: str, kind: str, candidate: str, stable: str | None,
              lineage: Mapping[str, str] | None = None) -> dict[str, str]:
    """Tags on a new ledger run; ``kind`` is canary | manual_promote | manual_rollback;
    ``lineage`` is the candidate's version tags (see ``LINEAGE``)."""
    return {
        TAG_CANARY_ID: cid,
        TAG_KIND: kind,
        TAG_CANDIDATE: candidate,
        TAG_STABLE: stable or "",
        TAG_OUTCOME: OUTCOME_RUNNING,
        **lineage_tags(lineage or {}),
    }


def open_params(
    candidate: str, stable: str | None, steps: tuple[float, ...], bake_s: float, max_duration_s: float,
    min_bake_s: float | None = None, budget_factor: float | None = None,
) -> dict[str, str]:
    """Run parameters: which versions and which schedule (and budget)."""
    out = {
        "candidate_version": candidate,
        "stable_version": stable or "",
        "steps": ",".join(f"{w:g}" for w in steps),
        "bake_s": f"{bake_s:g}",
        "max_duration_s": f"{max_duration_s:g}",
    }
    if min_bake_s is not None:
        out["min_bake_s"] = f"{min_bake_s:g}"
    out["budget_factor"] = "none" if budget_factor is None else f"{budget_factor:g}"
    return out


def step_metrics(
    weight: float,
    verdict: str,
    cohorts: Mapping[str, float],
    stats: Mapping[str, float],
    paused: bool,
) -> dict[str, float]:
    """Metrics of one judged tick: ``canary.weight``, ``canary.paused``, ``judge.verdict``,
    ``cohort.<arm>.<metric>`` and ``judge.<metric>.<stat>``. Non-finite values are
    dropped (MLflow stores them, but plots and comparisons choke on them)."""
    out: dict[str, float] = {
        "canary.weight": float(weight),
        "canary.paused": 1.0 if paused else 0.0,
        "judge.verdict": VERDICT_CODE.get(verdict, 0.0),
    }
    for key, value in cohorts.items():
        out[f"cohort.{key}"] = float(value)
    for key, value in stats.items():
        out[f"judge.{key}"] = float(value)
    return {k: v for k, v in out.items() if v == v and abs(v) != float("inf")}


def decision_tags(outcome: str, reason: str, decided_by: str, ts: float,
                  reasons: Sequence[str] = ()) -> dict[str, str]:
    """Tags of the final decision, on the run and mirrored on the model version; ``reasons``:
    the judge's, when it decided (listed one per line on the MLflow pages)."""
    if outcome not in OUTCOMES:
        raise ValueError(f"unknown outcome {outcome!r}; expected one of {OUTCOMES}")
    tags = {
        TAG_OUTCOME: outcome,
        TAG_DECISION: DECISION_OF[outcome],
        TAG_REASON: clip(reason),
        TAG_DECIDED_BY: decided_by,
        TAG_DECIDED_AT: iso(ts),
    }
    listed = json.dumps(list(reasons))
    if reasons and len(listed) <= MAX_TAG_CHARS:  # too long to keep whole: the reason alone
        tags[Tag.DECISION_REASONS] = listed
    return tags


REFUSED_KIND = "refused_command"
"""``rtrl.canary.kind`` of the ledger record of a refused operator command."""


def refusal_tags(record_id: str, kind: str, claimed: str, version: str | None, why: str,
                 ts: float) -> dict[str, str]:
    """Tags of the ledger record of an operator command the deployer refused: what it asked,
    whom it claimed to be from (unverified, so never ``decided_by``) and why it was refused."""
    asked = f"{kind} v{version}" if version else kind
    return {
        TAG_CANARY_ID: record_id,
        TAG_KIND: REFUSED_KIND,
        TAG_CANDIDATE: version or "",
        TAG_OUTCOME: "refused",
        TAG_DECISION: "refuse",
        TAG_REASON: clip(f"refused {asked} claimed by {claimed}: {why}"),
        TAG_DECIDED_BY: CONTROLLER,
        TAG_DECIDED_AT: iso(ts),
        TAG_CLAIMED_BY: clip(claimed),
    }


def version_tags(cid: str, outcome: str, reason: str, decided_by: str, ts: float,
                 reasons: Sequence[str] = ()) -> dict[str, str]:
    """What a model version carries after its canary: the decision plus the ledger run."""
    return {**decision_tags(outcome, reason, decided_by, ts, reasons), TAG_CANARY_ID: cid}


def summary(
    cid: str,
    candidate: str,
    stable: str | None,
    outcome: str,
    reason: str,
    decided_by: str,
    started_at: float,
    ts: float,
    reasons: tuple[str, ...],
    cohorts: Mapping[str, float],
    judged_on: Mapping[str, object] | None = None,
) -> dict[str, object]:
    """The ``decision.json`` artifact: the decision in one readable document, with what the
    last verdict was judged on besides the records (``judged_on``: deployer/cohorts.py's
    ``JudgedOn``; ``rtrl replay`` judges the canary again from it)."""
    return {
        "canary_id": cid,
        "candidate_version": candidate,
        "stable_version": stable,
        "outcome": outcome,
        "decision": DECISION_OF[outcome],
        "reason": reason,
        "decided_by": decided_by,
        "started_at": iso(started_at) if started_at else None,
        "decided_at": iso(ts),
        "judge_reasons": list(reasons),
        "last_cohorts": dict(cohorts),
        "judged_on": dict(judged_on or {}),
    }
