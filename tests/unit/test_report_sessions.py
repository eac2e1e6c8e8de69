"""The report's agent sessions (services/report/sessions.py) against hand-computed figures."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

import pytest

from services.report import sessions as rs
from services.report.write import write_report

pytestmark = pytest.mark.unit
T = 1_800_000_000.0


def _rec(version: str, arm: str, status: str, turns: int, ts: float, lead: bool = True) -> dict[str, Any]:
    return {"served_ts": ts, "model": {"name": "m", "version": version}, "arm": arm,
            "session_credit": {"turn": 0, "turns": turns, "status": status, "invalid_tool_calls": 0,
                               "lead": lead}}


def test_each_session_counts_once_by_its_lead_record() -> None:
    recs = [_rec("1", "stable", "completed", 4, T), _rec("1", "stable", "completed", 4, T + 1, lead=False),
            _rec("1", "stable", "abandoned", 3, T + 2), {"served_ts": T, "model": {"version": "1"}},
            _rec("2", "canary", "completed", 6, T + 3), _rec("1", "stable", "completed", 8, T + 4)]
    table = rs.by_version_arm(rs.session_rows(recs))
    one = table[("1", "stable")]
    assert (one.n, one.completed, one.completion, one.turns_per_completed) == (3, 2, 2 / 3, 6.0)
    assert one.turns_var == statistics.variance([4, 8])
    assert table[("2", "canary")].turns_var != table[("2", "canary")].turns_var  # NaN with one


def test_the_welch_interval_is_the_textbook_one() -> None:
    a = rs.figures([rs.SessionRow(T, "1", "holdout", "completed", t) for t in (4, 6, 8, 6)])
    b = rs.figures([rs.SessionRow(T, "2", "stable", "completed", t) for t in (3, 5, 4)])
    lo, hi = rs.mean_difference_interval(a, b)
    half = 1.96 * math.sqrt(statistics.variance([4, 6, 8, 6]) / 4 + statistics.variance([3, 5, 4]) / 3)
    assert (lo, hi) == pytest.approx((4 - 6 - half, 4 - 6 + half))
    assert math.isnan(rs.mean_difference_interval(a, rs.figures([]))[0])


def test_against_the_holdout_counts_the_champions_time_only_and_states_the_targets() -> None:
    rows = rs.session_rows(
        [_rec("1", "holdout", s, 5, T + i) for i, s in enumerate(["completed", "abandoned"] * 20)]
        + [_rec("2", "stable", "completed", 4 + i % 2, T + i) for i in range(30)]
        + [_rec("2", "stable", "abandoned", 2, T + 100 + i) for i in range(30)])  # after the period
    [p] = rs.periods_against_holdout(rows, [("2", "1", T, T + 50)])
    assert (p.holdout.n, p.holdout.completion, p.champion_figures.n, p.champion_figures.completion) == \
        (40, 0.5, 30, 1.0)
    assert p.completion_change == pytest.approx(1.0) and p.completion_ok
    assert p.turns_change == pytest.approx(-0.1) and p.turns_ok
    text = "\n".join(rs.section(rs.by_version_arm(rows), [p]))
    assert "session completion +100.0% (≥ +10%: met)" in text and "(no worse: met;" in text
    longer = rs.periods_against_holdout(
        [*rows, *rs.session_rows([_rec("3", "stable", "completed", 9 + i % 2, T + i) for i in range(30)])],
        [("3", "1", T, T + 50)])[0]
    text = "\n".join(rs.section({("3", "stable"): longer.champion_figures}, [longer]))
    assert not longer.turns_ok and "**not met**" in text


def test_the_report_has_sessions_only_when_records_carry_them(tmp_path: Path) -> None:
    served = {"request_id": "r", "served_ts": T, "model": {"name": "m", "version": "1"}, "arm": "stable",
              "completion_kind": "edit", "latency_ms": 100.0, "reward": 0.5, "accepted": True,
              "persistence": {"600": 1.0}}
    plain = write_report(tmp_path / "a", [served], [], primary_horizon_s=600, baseline_version="1",
                         final_version=None, bad_version=None, started=T, finished=T + 60, command="c",
                         mlflow_url="")
    assert "Agent sessions" not in plain.read_text()
    agent = write_report(tmp_path / "b", [{**served, **_rec("1", "stable", "completed", 3, T)}], [],
                         primary_horizon_s=600, baseline_version="1", final_version=None, bad_version=None,
                         started=T, finished=T + 60, command="c", mlflow_url="")
    text = agent.read_text()
    assert "## Agent sessions" in text and "| v1 | stable | 1 | 100.0% | 3.00 |" in text
