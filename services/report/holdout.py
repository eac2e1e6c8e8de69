"""The demo report's comparison against the long-term holdout (docs/holdout.md).

The holdout's users were served the pinned version (the bootstrap) all along, in the same
minutes as everyone else. For each champion's time — from the run's start, then from each
promotion to the next — the champion's users (arm ``stable``, the champion's version) are
compared with the holdout's (arm ``holdout``): the report's own metrics over those rows, and
the deployer's judge on the same records for the always-valid interval
(deployer/cohorts.HoldoutWindow, deployer/holdout.effects). The last champion's comparison
is the run's headline: the loop's total effect, measured directly.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from pydantic import ValidationError

from deployer import holdout
from deployer.cohorts import HoldoutWindow
from ingest.events import RewardRecord
from rollback.types import JudgePolicy
from services.report.cohorts import Cohort, Comparison, Row, cohort, compare, parse_ts
from services.report.markdown import _num, _pct
from services.report.sources import Decision

MIN_ROWS = 30
"""A champion's time with fewer rows on either side is listed but not judged against targets."""


@dataclass(frozen=True)
class HoldoutPeriod:
    """One champion's time against the holdout."""

    champion: str
    pinned: str
    start: float
    end: float
    holdout: Cohort
    champion_cohort: Cohort
    comparison: Comparison
    """Relative changes champion vs holdout and the targets (``baseline`` = the pinned version)."""
    intervals: dict[str, dict[str, float | None]] = field(default_factory=dict)
    """metric -> estimate, lower, upper (champion − holdout, always-valid), relative."""
    level: float = math.nan

    @property
    def measured(self) -> bool:
        return min(self.holdout.n, self.champion_cohort.n) >= MIN_ROWS and self.champion != self.pinned


def champion_times(decisions: Sequence[Decision], first: str, start: float, end: float,
                   ) -> list[tuple[str, float, float]]:
    """(champion, from, to) over ``[start, end)``: ``first``, then each promoted candidate."""
    out: list[tuple[str, float, float]] = []
    current, since = first, start
    for d in decisions:
        if d.outcome != "promoted":
            continue
        try:
            at = parse_ts(d.decided_at)
        except ValueError:
            continue
        out.append((current, since, at))
        current, since = d.candidate, at
    out.append((current, since, end))
    return [(v, a, b) for v, a, b in out if b > a]


def holdout_periods(records: Sequence[Mapping[str, Any]], rows: Sequence[Row], decisions: Sequence[Decision],
                    first: str | None, end: float, policy: JudgePolicy) -> list[HoldoutPeriod]:
    """Each champion's time against the holdout (none when no user was held out)."""
    held = [r for r in rows if r.arm == "holdout"]
    if not held or first is None:
        return []
    pinned = Counter(r.version for r in held).most_common(1)[0][0]
    start = min(r.served_ts for r in held)
    parsed = _parse(records)
    out = []
    for champion, a, b in champion_times(decisions, first, start, end):
        base = [r for r in held if r.version == pinned and a <= r.served_ts < b]
        champ = [r for r in rows if r.arm == "stable" and r.version == champion and a <= r.served_ts < b]
        cohorts = {"holdout": cohort(base), "champion": cohort(champ)}
        comparison = replace(compare(cohorts, "holdout", "champion"), baseline=pinned, final=champion)
        intervals, level = _intervals(parsed, pinned, champion, a, b, policy)
        lower = (intervals.get("dissatisfied") or {}).get("lower")
        if lower is not None:  # "no worse" = not confidently worse (a rare event: see section())
            comparison = replace(comparison, dissatisfied_ok=lower <= 0.0)
        out.append(HoldoutPeriod(champion, pinned, a, b, cohorts["holdout"], cohorts["champion"],
                                 comparison, intervals, level))
    return out


def _parse(records: Sequence[Mapping[str, Any]]) -> list[RewardRecord]:
    out = []
    for rec in records:
        try:
            out.append(RewardRecord.model_validate(rec))
        except ValidationError:
            continue
    return out


def _intervals(records: Sequence[RewardRecord], pinned: str, champion: str, a: float, b: float,
               policy: JudgePolicy) -> tuple[dict[str, dict[str, float | None]], float]:
    window = HoldoutWindow(pinned, champion, a, horizon_s=policy.persistence_horizon_s)
    window.add_all(r for r in records if r.served_ts.timestamp() < b)
    if not all(window.outcomes.values()):
        return {}, math.nan
    got = holdout.measure(window, policy, b)
    return holdout.effects_doc(got.effects), got.level


def headline(periods: Sequence[HoldoutPeriod]) -> HoldoutPeriod | None:
    """The last champion's comparison, when it has enough rows on both sides."""
    measured = [p for p in periods if p.measured]
    return measured[-1] if measured and measured[-1] is periods[-1] else None


# ---------------------------------------------------------------------------- text
def _interval(e: Mapping[str, float | None] | None, fmt: str) -> str:
    if not e:
        return "n/a"
    return f"{_num(e.get('estimate'), fmt)} [{_num(e.get('lower'), fmt)}, {_num(e.get('upper'), fmt)}]"


def section(periods: Sequence[HoldoutPeriod]) -> list[str]:
    """The report's "against the long-term holdout" section (nothing without a holdout)."""
    if not periods:
        return []
    pinned = periods[0].pinned
    level = next((p.level for p in periods if not math.isnan(p.level)), math.nan)
    lines = ["## Against the long-term holdout (same minutes)", "",
             f"A share of the users was held out on v{pinned} for the whole run: they never saw a "
             "canary or a promoted version. Each row is one champion's time, its users against the "
             "holdout's in the same minutes (stable arm vs holdout arm). Changes are relative; the "
             f"intervals are the deployer judge's always-valid {_pct(level).lstrip('+')} intervals on "
             "champion − holdout (absolute units).", "",
             "| champion | minutes | n holdout / champion | edit persistence | mean latency ms | "
             "dissatisfied | persistence interval | latency interval (ms) |",
             "|---|---|---|---|---|---|---|---|"]
    for p in periods:
        h, c, cmp = p.holdout, p.champion_cohort, p.comparison
        lines.append(
            f"| v{p.champion} | {(p.end - p.start) / 60:.1f} | {h.n} / {c.n} | "
            f"{_num(h.edit_persistence)} → {_num(c.edit_persistence)} ({_pct(cmp.persistence_change)}) | "
            f"{_num(h.latency_ms, '.1f')} → {_num(c.latency_ms, '.1f')} ({_pct(cmp.latency_change)}) | "
            f"{_num(h.dissatisfied_rate)} → {_num(c.dissatisfied_rate)} ({_pct(cmp.dissatisfied_change)}) | "
            f"{_interval(p.intervals.get('persistence'), '.3f')} | "
            f"{_interval(p.intervals.get('latency_ms'), '.1f')} |")
    best = headline(periods)
    ok = {True: "met", False: "**not met**"}
    if best is None:
        last = periods[-1]
        why = (f"is the holdout's own version v{last.pinned}: nothing was promoted, so the row is an A/A "
               "comparison, not a result" if last.champion == last.pinned
               else f"served too few requests beside the holdout (fewer than {MIN_ROWS} on a side)")
        lines += ["", f"The last champion {why}; it is not judged against the targets.", ""]
        return lines
    cmp = best.comparison
    lines += ["", f"**The last champion v{best.champion} against the holdout v{best.pinned}, same minutes:** "
                  f"edit persistence {_pct(cmp.persistence_change)} (≥ +10%: {ok[cmp.persistence_ok]}), "
                  f"mean latency {_pct(cmp.latency_change)} (≤ −10%: {ok[cmp.latency_ok]}), dissatisfied "
                  f"follow-ups {_pct(cmp.dissatisfied_change)} (no worse: {ok[cmp.dissatisfied_ok]}; "
                  f"interval {_interval(best.intervals.get('dissatisfied'), '.3f')}).", "",
              "Dissatisfied follow-ups are rare (a few percent of requests), so against a small holdout "
              "their point change swings widely; \"no worse\" is met when the always-valid interval does "
              "not show the champion worse (its lower bound is at most 0).", ""]
    return lines


def summary(periods: Sequence[HoldoutPeriod]) -> dict[str, Any] | None:
    """summary.json's ``holdout``: every period and the headline (None without a holdout)."""
    if not periods:
        return None
    best = headline(periods)

    def doc(p: HoldoutPeriod) -> dict[str, Any]:
        return {"champion": p.champion, "pinned": p.pinned, "start": p.start, "end": p.end,
                "n_holdout": p.holdout.n, "n_champion": p.champion_cohort.n,
                "comparison": asdict(p.comparison), "intervals": p.intervals, "level": p.level}

    return {"periods": [doc(p) for p in periods], "headline": doc(best) if best else None}
