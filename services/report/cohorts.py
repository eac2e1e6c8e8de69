"""The demo report's maths: reward records to rows, rows to cohort metrics, and comparisons.

Pure: no I/O, no clock. Metric definitions (per version, over all the completions it served,
either arm):

the cohort summary of ``ingest.contracts.metrics`` (the one the judge's ledger shows), with
edit persistence at the reward spec's primary horizon, the horizon the judge decides on.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ingest.contracts.metrics import Summary, edit_persistence, summarise


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
    tool_calls: int = 0
    invalid_tool_calls: int = 0

    @property
    def completion_kind(self) -> str:
        return self.kind


def parse_ts(value: Any) -> float:
    """Epoch seconds of a number or an ISO-8601 time (``Z`` allowed); ValueError otherwise."""
    if isinstance(value, int | float):
        return float(value)
    return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()


def row_from_record(rec: Mapping[str, Any], primary_s: int) -> Row:
    accepted = rec.get("accepted")
    kind = str(rec.get("completion_kind", "edit"))
    return Row(
        served_ts=parse_ts(rec["served_ts"]),
        version=str(rec["model"]["version"]),
        arm=str(rec.get("arm", "stable")),
        kind=kind,
        accepted=accepted if isinstance(accepted, bool) else None,
        persistence=edit_persistence(kind, accepted if isinstance(accepted, bool) else None,
                                     rec.get("persistence") or {}, primary_s),
        latency_ms=float(rec["latency_ms"]),
        reward=float(rec["reward"]),
        dissatisfied=int(rec.get("dissatisfied", 0)),
        tool_calls=int(rec.get("tool_calls", 0)),
        invalid_tool_calls=int(rec.get("invalid_tool_calls", 0)),
    )


Cohort = Summary
"""The report's figures of one version or arm (``ingest.contracts.metrics.Summary``)."""


def cohort(rows: Sequence[Row]) -> Cohort:
    """The cohort summary over ``rows`` (NaN where a figure has no data)."""
    return summarise(rows)


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
    """The demo's three online figures, as relative changes against the bootstrap champion."""

    persistence_up: float = 0.10
    latency_down: float = 0.10
    dissatisfied_up: float = 0.0
    """The dissatisfied follow-up rate may rise by at most this (0: no worse than stable)."""

    def dissatisfied_ok(self, change: float) -> bool:
        """No worse than allowed; a change that cannot be measured (no follow-up on the
        stable side, NaN) is not a met target."""
        return not math.isnan(change) and change <= self.dissatisfied_up


@dataclass(frozen=True)
class Comparison:
    baseline: str
    final: str
    persistence_change: float
    latency_change: float
    persistence_ok: bool
    latency_ok: bool
    dissatisfied_change: float = math.nan
    dissatisfied_ok: bool = False


def compare(cohorts: Mapping[str, Cohort], baseline: str, final: str,
            targets: Targets = Targets()) -> Comparison:
    b, f = cohorts[baseline], cohorts[final]
    dp = relative_change(b.edit_persistence, f.edit_persistence)
    dl = relative_change(b.latency_ms, f.latency_ms)
    dd = relative_change(b.dissatisfied_rate, f.dissatisfied_rate)
    return Comparison(baseline, final, dp, dl,
                      persistence_ok=dp >= targets.persistence_up,
                      latency_ok=dl <= -targets.latency_down,
                      dissatisfied_change=dd, dissatisfied_ok=targets.dissatisfied_ok(dd))


@dataclass(frozen=True)
class Chain:
    """The promotions that lead from the bootstrap champion to the last one, each measured
    side by side during its canary, and their compounded relative change."""

    versions: tuple[str, ...]
    persistence_change: float
    latency_change: float
    persistence_ok: bool
    latency_ok: bool
    dissatisfied_change: float = math.nan
    """NaN when a step's stable arm had no dissatisfied follow-up (a relative change from 0)."""
    dissatisfied_ok: bool = False


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
    versions, dp, dl, dd, cur = [baseline], 1.0, 1.0, 1.0, baseline
    while cur != final and cur in nxt and len(versions) <= len(steps):
        cand, st, ca = nxt[cur]
        dp *= 1 + relative_change(st.edit_persistence, ca.edit_persistence)
        dl *= 1 + relative_change(st.latency_ms, ca.latency_ms)
        dd *= 1 + relative_change(st.dissatisfied_rate, ca.dissatisfied_rate)
        versions.append(cand)
        cur = cand
    if cur != final or len(versions) < 2 or math.isnan(dp) or math.isnan(dl):
        return None  # no lineage, or a step without both arms measured
    return Chain(tuple(versions), dp - 1, dl - 1, dp - 1 >= targets.persistence_up,
                 dl - 1 <= -targets.latency_down, dd - 1, targets.dissatisfied_ok(dd - 1))


def side_by_side(rows: Sequence[Row], stable: str, candidate: str, start: float, end: float,
                 ) -> tuple[Cohort, Cohort]:
    """Both arms over the same window (a canary's life): stable ``stable`` vs ``candidate``
    (the long-term holdout's users, served the same version as stable, are not stable's arm)."""
    inside = [r for r in rows if start <= r.served_ts <= end and r.arm != "holdout"]
    return (cohort([r for r in inside if r.version == stable]),
            cohort([r for r in inside if r.version == candidate]))
