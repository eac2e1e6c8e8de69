"""The demo report against the long-term holdout (services/report/holdout.py)."""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime
from pathlib import Path

import pytest

from rollback.types import JudgePolicy
from services.report.cohorts import row_from_record, side_by_side
from services.report.holdout import MIN_ROWS, champion_times, headline, holdout_periods, section
from services.report.sources import Decision
from services.report.write import write_report

T = 1_700_000_000.0


def record(i: int, version: str, arm: str, served: float, persist: float, latency: float,
           dissatisfied: int = 0) -> dict[str, object]:
    """A reward record as the rewards topic holds it (JSON), for both the report and the judge."""
    ts = datetime.fromtimestamp(served, UTC).isoformat()
    return {
        "request_id": f"r{i}-{arm}-{version}", "served_event_id": f"e{i}", "session_id": "s",
        "user_key": f"u{i % 97}-{arm}", "served_ts": ts, "closed_ts": ts,
        "model": {"name": "m", "version": version}, "arm": arm, "prompt_tokens": [1],
        "completion_tokens": [2, 3], "behavior_logprobs": [-0.1, -0.2], "latency_ms": latency,
        "completion_kind": "edit", "accepted": True, "persistence": {"600": persist}, "reward": persist,
        "components": {}, "reward_spec_version": "t", "dissatisfied": dissatisfied,
    }


def decision(cand: str, stable: str, outcome: str, at: float) -> Decision:
    return Decision(f"canary-v{cand}", cand, stable, outcome, "r", "controller",
                    datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), at - 60)


@pytest.mark.parametrize(("decisions", "expect"), [
    ([], [("1", T, T + 300)]),
    ([decision("2", "1", "promoted", T + 100)], [("1", T, T + 100), ("2", T + 100, T + 300)]),
    ([decision("2", "1", "rolled_back", T + 100), decision("3", "1", "promoted", T + 200)],
     [("1", T, T + 200), ("3", T + 200, T + 300)]),
    ([decision("2", "1", "promoted", T)], [("2", T, T + 300)]),  # an empty first time is left out
])
def test_champion_times(decisions: list[Decision], expect: list[tuple[str, float, float]]) -> None:
    assert champion_times(decisions, "1", T, T + 300) == expect


def world(seed: int = 1, every: int = 20) -> tuple[list[dict[str, object]], list[Decision]]:
    """v1 pinned for the holdout all along; v1 champion until T+100, then v2 (persistence
    0.4 -> 0.5, latency 300 -> 240 ms); a canary of v3 that must not count."""
    rng = random.Random(seed)
    recs = []
    for i in range(600):
        t = T + i * 0.5
        recs.append(record(i, "1", "holdout", t, rng.gauss(0.4, 0.05), rng.gauss(300, 20),
                           dissatisfied=int(i % 10 == 0)))
        champ = "1" if t < T + 100 else "2"
        better = champ == "2"
        recs.append(record(i, champ, "stable", t, rng.gauss(0.5 if better else 0.4, 0.05),
                           rng.gauss(240 if better else 300, 20),
                           dissatisfied=int(i % (every if better else 10) == 0)))
        recs.append(record(i, "3", "canary", t, 0.0, 900))
    return recs, [decision("2", "1", "promoted", T + 100)]


def test_each_champion_is_compared_with_the_holdout_in_its_own_minutes() -> None:
    recs, decisions = world()
    rows = [row_from_record(r, 600) for r in recs]
    periods = holdout_periods(recs, rows, decisions, "1", T + 300, JudgePolicy(alpha=0.05))
    assert [(p.champion, p.pinned, p.start, p.end) for p in periods] == [("1", "1", T, T + 100),
                                                                         ("2", "1", T + 100, T + 300)]
    aa, ab = periods
    assert (aa.holdout.n, aa.champion_cohort.n) == (200, 200)  # the canary's records are not counted
    assert abs(aa.comparison.persistence_change) < 0.05 and not aa.measured  # v1 against itself
    assert ab.comparison.persistence_change == pytest.approx(0.25, abs=0.03)
    assert ab.comparison.latency_change == pytest.approx(-0.2, abs=0.02)
    assert ab.comparison.persistence_ok and ab.comparison.latency_ok
    p = ab.intervals["persistence"]
    assert p["lower"] is not None and p["upper"] is not None
    assert 0.0 < p["lower"] < 0.1 < p["upper"]  # the always-valid interval covers the true +0.1
    assert ab.intervals["latency_ms"]["upper"] < 0.0  # type: ignore[operator]
    assert headline(periods) is ab
    text = "\n".join(section(periods))
    assert "## Against the long-term holdout" in text and "| v2 | 3.3 | 400 / 400 |" in text
    assert "**The last champion v2 against the holdout v1, same minutes:** edit persistence +2" in text
    assert "(≥ +10%: met)" in text and "**not met**" not in text


@pytest.mark.parametrize(("every", "ok"), [(20, True), (9, True), (2, False)])
def test_dissatisfied_is_no_worse_unless_the_interval_shows_it_worse(every: int, ok: bool) -> None:
    """1 in 10 held-out requests is followed by a dissatisfied follow-up; the champion's 1 in
    ``every``: fewer, slightly more (not shown worse), five times as many (shown worse)."""
    recs, decisions = world(every=every)
    rows = [row_from_record(r, 600) for r in recs]
    last = holdout_periods(recs, rows, decisions, "1", T + 300, JudgePolicy(alpha=0.05))[-1]
    assert last.comparison.dissatisfied_ok is ok
    assert (last.comparison.dissatisfied_change > 0) is (every < 10)


def test_no_holdout_no_section_and_a_short_last_time_is_not_judged() -> None:
    recs, decisions = world()
    rows = [row_from_record(r, 600) for r in recs if r["arm"] != "holdout"]
    assert holdout_periods(recs, rows, decisions, "1", T + 300, JudgePolicy()) == []
    assert section([]) == []
    rows = [row_from_record(r, 600) for r in recs]
    late = decision("4", "2", "promoted", T + 299.5 - (MIN_ROWS - 5) * 0.5)
    periods = holdout_periods(recs, rows, [*decisions, late], "1", T + 300, JudgePolicy())
    assert periods[-1].champion == "4" and headline(periods) is None
    assert "too few requests beside the holdout" in "\n".join(section(periods))
    unpromoted = holdout_periods(recs, rows, [], "1", T + 300, JudgePolicy())
    assert [p.champion for p in unpromoted] == ["1"] and headline(unpromoted) is None
    text = "\n".join(section(unpromoted))
    assert "is the holdout's own version v1: nothing was promoted" in text and "too few" not in text


def test_side_by_side_leaves_the_holdouts_users_out_of_stable() -> None:
    rows = [row_from_record(r, 600) for r in (
        record(1, "1", "stable", T + 1, 0.4, 300), record(2, "1", "holdout", T + 2, 0.9, 50),
        record(3, "2", "canary", T + 3, 0.5, 200))]
    st, ca = side_by_side(rows, "1", "2", T, T + 60)
    assert (st.n, ca.n) == (1, 1) and st.edit_persistence == pytest.approx(0.4)


def test_the_report_and_its_summary_carry_the_holdout(tmp_path: Path) -> None:
    recs, decisions = world()
    path = write_report(tmp_path / "r", recs, decisions, primary_horizon_s=600, baseline_version="1",
                        final_version="2", bad_version=None, started=T, finished=T + 300, command="c",
                        mlflow_url="u", judge_policy=JudgePolicy(alpha=0.05))
    assert "Against the long-term holdout" in path.read_text()
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    head = summary["holdout"]["headline"]
    assert head["champion"] == "2" and head["comparison"]["persistence_ok"]
    assert head["intervals"]["persistence"]["lower"] > 0
