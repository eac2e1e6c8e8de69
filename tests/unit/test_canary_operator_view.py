"""The operator's views (pure renderers of rtrl status / rtrl history)."""

from __future__ import annotations

from deployer.status import CanaryStatus, Phase
from services.cli.operator import render_history, render_status, render_trainer


def test_status_table_shows_versions_phase_weight_verdict_and_cohorts() -> None:
    status = CanaryStatus(
        phase=Phase.PROGRESSING, paused=True, canary_id="canary-v2-x", candidate="2", stable="1", step=1,
        weight=0.05, phase_since=1000.0, ticks=7, verdict="continue",
        reasons=("Waiting for 200 users per arm (stable 150, canary 12).",),
        cohorts={"stable.n": 150.0, "canary.n": 12.0, "stable.reward_mean": 0.5, "canary.reward_mean": 0.61},
    )
    out = render_status(status, {"champion": "1", "candidate": "2", "previous": None}, {"2": "pass"},
                        {"canary_weight": "0.05", "stable_version": "1", "canary_version": "2"},
                        "controller-abc", now=1090.0)
    lines = out.splitlines()
    assert "champion     v1" in lines[0] and "candidate    v2 (gate pass)" == lines[1]
    assert "previous     -" == lines[2]
    assert "progressing for 1m30s  [PAUSED]" in lines[3]
    assert "5.0% of users on the canary" in out and "step 2" in out
    assert "continue after 7 judged ticks" in out and "controller-abc" in out
    assert "  - Waiting for 200 users" in out
    assert any(line.split() == ["reward_mean", "0.500", "0.610"] for line in lines)
    assert any(line.split() == ["n", "150", "12"] for line in lines)


def test_status_of_a_fresh_install_and_empty_history() -> None:
    out = render_status(CanaryStatus(), {}, {}, {}, None, now=0.0)
    assert "idle" in out and "none running" in out and "0.0% of users" in out
    assert render_history([]) == "no canaries recorded yet"


def test_history_rows() -> None:
    rows = [{"started_ms": 1_800_000_000_000, "canary_id": "canary-v2-20270115T080000Z",
             "decision": "rollback", "decided_by": "controller", "reason": "judge: canary worse",
             "outcome": "rolled_back"},
            {"started_ms": 1_799_000_000_000, "canary_id": "canary-v1-x", "decision": "", "decided_by": "",
             "reason": "", "outcome": "running"}]
    lines = render_history(rows).splitlines()
    assert lines[1].startswith("2027-01-15 08:00") and "rollback" in lines[1]
    assert "judge: canary worse" in lines[1]
    assert lines[2].split()[-1] == "running"


def test_status_says_what_the_trainer_waits_for() -> None:
    now = 1_700_000_000.0
    waiting = {"start": False, "trigger": "", "waiting_for": "canary", "records": 5123, "ess": 812.4,
               "reason": "canary v7 in flight: a candidate trained now could not be offered", "at": now - 12}
    text = render_trainer(waiting, now)
    assert text.splitlines()[0] == ("trainer      waiting (0m12s ago): canary v7 in flight: a candidate "
                                    "trained now could not be offered")
    assert "5123 records since the last window, effective sample size 812" in text
    started = {**waiting, "start": True, "trigger": "records", "reason": "5123 records (>= 5000)"}
    assert "starting an increment" in render_trainer(started, now)
    assert "no trainer service has reported" in render_trainer(None, now)


def test_status_shows_the_canary_plan_per_primary_metric() -> None:
    plan = {"users_per_min": 42.0, "eta_s": 1500.0, "budget_left_s": 7200.0, "warning": "",
            "metrics": [{"metric": "persistence", "margin": 0.03, "users": 1234, "needed": 3180,
                         "eta_s": 1500.0, "decided": False},
                        {"metric": "latency_ms", "margin": 50.0, "users": 1234, "needed": 800,
                         "eta_s": 0.0, "decided": True},
                        {"metric": "dissatisfied", "margin": 0.02, "users": 3, "needed": None,
                         "eta_s": None, "decided": False}]}
    status = CanaryStatus(phase=Phase.PROGRESSING, canary_id="c", candidate="2", stable="1", step=2,
                          weight=0.25, ticks=5, verdict="continue", plan=plan, budget_users=6360)
    out = render_status(status, {}, {}, {}, None, now=0.0)
    assert ("42.0 new users/min; every primary metric decided in ~25 min (budget: 6,360 canary users, "
            "120 min left of the time cap)") in out
    assert "persistence       1,234 of 3,180 canary users, in ~25 min" in out
    assert "latency_ms        decided" in out and "3 canary users, no variance seen yet" in out
    beyond = render_status(CanaryStatus(phase=Phase.PROGRESSING, plan={**plan, "warning": "needs more"}),
                           {}, {}, {}, None, now=0.0)
    assert "  ! needs more" in beyond and "(budget: 120 min left of the time cap)" in beyond
    assert "plan" not in render_status(CanaryStatus(phase=Phase.SUCCEEDED, plan=plan), {}, {}, {}, None, 0.0)
    assert CanaryStatus.from_json(status.to_json()).plan == plan
