"""The demo report's agent sessions (a reward spec with ``[session]``): each session counted
once, through the reward record that leads it (``session_credit.lead``), by the version and
arm of that record.

Pure: no I/O. Figures per version and arm, and each champion's time against the long-term
holdout (the periods of services/report/holdout.py): session completion rate and turns per
completed session.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from services.report.cohorts import parse_ts, relative_change
from services.report.markdown import _num, _pct

COMPLETION_UP = 0.10
"""The agent demo's target: the last champion completes 10% more sessions than the holdout."""


@dataclass(frozen=True)
class SessionRow:
    served_ts: float
    version: str
    arm: str
    status: str
    turns: int


@dataclass(frozen=True)
class SessionFigures:
    n: int
    completion: float
    """Share of sessions completed (NaN with none)."""
    turns_per_completed: float
    """Mean turns of the completed sessions (NaN with none)."""
    turns_var: float = math.nan
    """Sample variance of the completed sessions' turns (NaN with fewer than two)."""
    completed: int = 0


def mean_difference_interval(a: SessionFigures, b: SessionFigures, z: float = 1.96) -> tuple[float, float]:
    """(lower, upper) of a 95% Welch interval on b's turns per completed session minus a's;
    NaN when either side has fewer than two completed sessions."""
    if a.completed < 2 or b.completed < 2:
        return math.nan, math.nan
    diff = b.turns_per_completed - a.turns_per_completed
    half = z * math.sqrt(a.turns_var / a.completed + b.turns_var / b.completed)
    return diff - half, diff + half


def session_rows(records: Sequence[Mapping[str, Any]]) -> list[SessionRow]:
    """One row per session: its lead record's time, version, arm, status and turns."""
    out = []
    for rec in records:
        credit = rec.get("session_credit")
        if not isinstance(credit, Mapping) or not credit.get("lead"):
            continue
        out.append(SessionRow(parse_ts(rec["served_ts"]), str(rec["model"]["version"]),
                              str(rec.get("arm", "stable")), str(credit["status"]), int(credit["turns"])))
    return out


def figures(rows: Sequence[SessionRow]) -> SessionFigures:
    done = [r.turns for r in rows if r.status == "completed"]
    mean = sum(done) / len(done) if done else math.nan
    var = sum((t - mean) ** 2 for t in done) / (len(done) - 1) if len(done) > 1 else math.nan
    return SessionFigures(len(rows), len(done) / len(rows) if rows else math.nan, mean, var, len(done))


def by_version_arm(rows: Sequence[SessionRow]) -> dict[tuple[str, str], SessionFigures]:
    groups: dict[tuple[str, str], list[SessionRow]] = {}
    for r in rows:
        groups.setdefault((r.version, r.arm), []).append(r)
    return {k: figures(g) for k, g in sorted(groups.items())}


@dataclass(frozen=True)
class SessionPeriod:
    """One champion's time: its users' sessions (stable arm) against the holdout's."""

    champion: str
    pinned: str
    holdout: SessionFigures
    champion_figures: SessionFigures
    completion_change: float
    turns_change: float
    turns_interval: tuple[float, float] = (math.nan, math.nan)
    """95% interval on champion − holdout turns per completed session."""

    @property
    def completion_ok(self) -> bool:
        return self.completion_change >= COMPLETION_UP

    @property
    def turns_ok(self) -> bool:
        """No worse: the interval does not show the champion's completed sessions longer (its
        lower bound is at most 0), the rule the report's dissatisfied follow-ups follow."""
        lower = self.turns_interval[0]
        return not math.isnan(lower) and lower <= 0.0


def periods_against_holdout(rows: Sequence[SessionRow],
                            times: Sequence[tuple[str, str, float, float]]) -> list[SessionPeriod]:
    """``times``: (champion, pinned, from, to) of each champion's time against the holdout."""
    out = []
    for champion, pinned, a, b in times:
        held = figures([r for r in rows if r.arm == "holdout" and r.version == pinned
                        and a <= r.served_ts < b])
        champ = figures([r for r in rows if r.arm == "stable" and r.version == champion
                         and a <= r.served_ts < b])
        out.append(SessionPeriod(champion, pinned, held, champ,
                                 relative_change(held.completion, champ.completion),
                                 relative_change(held.turns_per_completed, champ.turns_per_completed),
                                 mean_difference_interval(held, champ)))
    return out


def section(table: Mapping[tuple[str, str], SessionFigures], periods: Sequence[SessionPeriod],
            min_sessions: int = 30) -> list[str]:
    """The report's "Agent sessions" section (nothing without sessions)."""
    if not table:
        return []
    lines = ["## Agent sessions", "",
             "Each session counted once, by the version and arm of its first credited turn.", "",
             "| version | arm | sessions | completed | turns per completed |", "|---|---|---|---|---|"]
    for (version, arm), f in table.items():
        lines.append(f"| v{version} | {arm} | {f.n} | {_num(f.completion, '.1%')} | "
                     f"{_num(f.turns_per_completed, '.2f')} |")
    lines.append("")
    if periods:
        lines += ["Against the long-term holdout, same minutes:", "",
                  "| champion | sessions holdout / champion | completed | turns per completed |",
                  "|---|---|---|---|"]
        for p in periods:
            h, c = p.holdout, p.champion_figures
            lines.append(f"| v{p.champion} | {h.n} / {c.n} | {_num(h.completion, '.1%')} → "
                         f"{_num(c.completion, '.1%')} ({_pct(p.completion_change)}) | "
                         f"{_num(h.turns_per_completed, '.2f')} → {_num(c.turns_per_completed, '.2f')} "
                         f"({_pct(p.turns_change)}) |")
        last = periods[-1]
        ok = {True: "met", False: "**not met**"}
        if min(last.holdout.n, last.champion_figures.n) >= min_sessions:
            lines += ["", f"**The last champion v{last.champion} against the holdout v{last.pinned}:** "
                          f"session completion {_pct(last.completion_change)} (≥ +10%: "
                          f"{ok[last.completion_ok]}), turns per completed session "
                          f"{_pct(last.turns_change)} (no worse: {ok[last.turns_ok]}; 95% interval "
                          f"{_num(last.turns_interval[0], '+.2f')} to {_num(last.turns_interval[1], '+.2f')} "
                          "turns)."]
        lines.append("")
    return lines


def summary(table: Mapping[tuple[str, str], SessionFigures],
            periods: Sequence[SessionPeriod]) -> dict[str, Any] | None:
    """summary.json's ``sessions`` (None without sessions)."""
    if not table:
        return None
    return {"by_version_arm": [{"version": v, "arm": a, **asdict(f)} for (v, a), f in table.items()],
            "periods": [{**asdict(p), "completion_ok": p.completion_ok, "turns_ok": p.turns_ok}
                        for p in periods]}
