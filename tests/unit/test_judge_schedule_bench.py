"""``rtrl bench judge --schedule`` (bench/judge_schedule.py): its generator does not share the
judge's grid (requests fall anywhere in time, a user's requests span several strata, users
move to the canary as the weight grows), and one whole canary runs through the deployer's
own state machine to a decision."""

from __future__ import annotations

import numpy as np
import pytest

from bench.judge_schedule import HOURS, SHAPES, Traffic, run_canary, summarise, upper95
from rollback.types import JudgePolicy

pytestmark = pytest.mark.unit


def test_requests_fall_anywhere_in_time_and_users_span_several_strata() -> None:
    traffic = Traffic(SHAPES["A/A, drift"], np.random.default_rng(3), users_per_min=20.0)
    assert np.all(np.diff(traffic.t) >= 0) and traffic.t.max() <= HOURS * 3600.0
    on_a_30s_grid = np.isclose(traffic.t % 30.0, 0.0).mean()
    assert on_a_30s_grid < 0.01, "requests are not stamped on a tick grid"
    stratum = JudgePolicy().stratum_s
    per_user: dict[int, set[int]] = {}
    for t, u in zip(traffic.t, traffic.user, strict=True):
        per_user.setdefault(int(u), set()).add(int(t // stratum))
    several = np.mean([len(s) >= 3 for s in per_user.values() if len(s) >= 1])
    assert several > 0.4, f"only {several:.0%} of users reach 3 strata"


def test_zipf_users_are_heavier_at_the_top_than_even_users() -> None:
    def top_share(shape: str) -> float:
        t = Traffic(SHAPES[shape], np.random.default_rng(4), users_per_min=20.0)
        counts = np.sort(np.bincount(t.user))[::-1]
        return float(counts[: max(1, len(counts) // 100)].sum() / counts.sum())

    assert top_share("A/A, Zipf users") > 2 * top_share("A/A, drift")


def test_users_move_to_the_canary_as_the_weight_grows_and_never_back() -> None:
    traffic = Traffic(SHAPES["A/A, drift"], np.random.default_rng(5), users_per_min=30.0)
    arms: dict[str, list[str]] = {}
    for until, weight in ((3600.0, 0.05), (7200.0, 0.25), (10_800.0, 0.5)):
        for arm, outcome, visible in traffic.served(until, weight):
            assert visible > outcome.ts + 599
            arms.setdefault(outcome.user_key, []).append(arm)
    moved = [a for a in arms.values() if "stable" in a and "canary" in a]
    assert moved, "some users move from stable to the canary"
    assert all(a.index("canary") > max(i for i, x in enumerate(a) if x == "stable") for a in moved)


def test_a_clear_regression_is_rolled_back_by_the_deployers_own_state_machine() -> None:
    result = run_canary("latency +1 MDE", seed=11, tick_s=300.0, users_per_min=60.0)
    assert result.outcome == "rolled_back" and "latency" in result.reason.lower()
    assert 0 < result.hours < HOURS and result.canary_users > 0


def test_the_summary_counts_and_bounds() -> None:
    assert upper95(0, 500) == pytest.approx(0.00735, abs=2e-4)  # the rule of three, near 3/n
    assert upper95(5, 5) == 1.0
    from bench.judge_schedule import Result

    rows = [Result("s", "promoted", 1.0, 100, ""), Result("s", "promoted", 3.0, 300, ""),
            Result("s", "rolled_back", 0.5, 20, ""), Result("s", "aborted", 6.0, 900, "budget")]
    s = summarise(rows)
    assert s["promoted"] == 2 and s["rolled_back"] == 1 and s["promotion_rate"] == 0.5
    assert s["median_users_to_promotion"] == 200.0 and s["median_hours_to_rollback"] == 0.5


def test_agent_sessions_follow_the_users_propensities_and_the_canarys_effect() -> None:
    def sessions(shape: str) -> dict[str, list]:
        traffic = Traffic(SHAPES[shape], np.random.default_rng(6), users_per_min=60.0)
        by: dict[str, list] = {"stable": [], "canary": []}
        for arm, o, visible in traffic.served(HOURS * 3600.0, 0.5):
            assert o.session_turns >= 1 and visible > o.ts + 600 + 20 * o.session_turns - 1e-6
            by[arm].append(o)
        return by

    def rate(os: list, f: str) -> float:
        return float(np.mean([getattr(o, f) for o in os]))

    aa = sessions("A/A, agent sessions, Zipf")
    assert 0.3 < rate(aa["stable"], "session_completed") < 0.6
    assert abs(rate(aa["canary"], "session_completed") - rate(aa["stable"], "session_completed")) < 0.03
    worse = sessions("completion -2 MDE, agent, Zipf")
    drop = rate(worse["stable"], "session_completed") - rate(worse["canary"], "session_completed")
    assert 0.06 < drop < 0.14
    done = [o.session_turns for o in aa["stable"] if o.session_completed]
    gave_up = [o.session_turns for o in aa["stable"] if not o.session_completed]
    assert np.mean(gave_up) > np.mean(done) + 1  # an abandoned session ran longer
    plain = Traffic(SHAPES["A/A, drift"], np.random.default_rng(6), users_per_min=60.0)
    assert all(o.session_turns == 0 for _, o, _ in plain.served(3600.0, 0.5))


def test_session_regressions_are_judged_on_the_per_session_metrics() -> None:
    result = run_canary("invalid calls +1 MDE, agent", seed=12, tick_s=300.0, users_per_min=60.0)
    assert result.outcome == "rolled_back"
    assert "sessions with an invalid tool call" in result.reason, result.reason


def test_a_shorter_run_stops_each_canary_at_its_hours() -> None:
    result = run_canary("A/A, drift", seed=13, tick_s=300.0, users_per_min=60.0, hours=0.5)
    assert result.outcome == "undecided" and result.hours == 0.5  # 200 users per arm take longer
    assert 0 < result.canary_users < 200
