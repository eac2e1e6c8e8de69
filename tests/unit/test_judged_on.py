"""What a verdict is judged on (deployer/cohorts.py's ``JudgedOn``): every caller judges a
window through ``judge_window``, the record survives JSON (the ledger's decision.json and the
persisted status), and ``rtrl replay`` re-judges a recorded canary on exactly the records its
deployer had read."""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime, timedelta

import pytest

from deployer.cohorts import CohortWindow, JudgedOn, judge_window, judgement
from deployer.status import CanaryStatus, Phase
from ingest.events import ModelRef, RewardRecord
from ingest.reward.replay import Pair
from rollback.judge import judge
from rollback.types import JudgePolicy
from services.cli.replay import canaries, recorded_inputs, render

T0 = datetime(2027, 3, 1, 9, 0, tzinfo=UTC)
START = T0.timestamp()


def record(i: int, arm: str, reward: float, served_s: float, errors_ok: bool = True) -> RewardRecord:
    served = T0 + timedelta(seconds=served_s)
    return RewardRecord(
        request_id=f"{arm}{i}", served_event_id=f"e{arm}{i}", session_id="s", user_key=f"{arm}-u{i % 150}",
        served_ts=served, closed_ts=served + timedelta(seconds=5),
        model=ModelRef(name="m", version="1" if arm == "stable" else "2"), arm=arm,  # type: ignore[arg-type]
        prompt_tokens=[1, 2], completion_tokens=[3, 4], behavior_logprobs=[-0.1, -0.2],
        latency_ms=400.0 + 50 * (i % 7), completion_kind="edit", accepted=reward > 0.5,
        persistence={"600": 0.8}, reward=reward, components={"acceptance": reward},
        reward_spec_version="default-v1")


def arms(n: int, canary_shift: float, seed: int, spread_s: float = 600.0) -> list[RewardRecord]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        out.append(record(i, "stable", rng.gauss(0.5, 0.2), rng.uniform(0, spread_s)))
        out.append(record(i, "canary", rng.gauss(0.5 + canary_shift, 0.2), rng.uniform(0, spread_s)))
    return out


ON = JudgedOn(started_at=START, at=START + 900.0, step_times=(START + 30.0, START + 330.0),
              requests={"stable": 2000, "canary": 600}, errors={"stable": 3, "canary": 9},
              user_errors={"canary": (("canary-u3", START + 60.0, 2),)}, read_to={0: 17, 3: 4},
              verdict="continue")


def test_judged_on_survives_json_and_reads_its_own_boundaries() -> None:
    doc = json.loads(json.dumps(ON.to_doc()))
    assert JudgedOn.from_doc(doc) == ON
    assert ON.boundaries == (START, START + 30.0, START + 330.0) and ON.elapsed_s == 900.0
    assert ON.saw(0, 16) and not ON.saw(0, 17) and not ON.saw(1, 0) and ON.saw(3, 3)
    with pytest.raises(KeyError):
        JudgedOn.from_doc({"at": 1.0})
    assert recorded_inputs({"judged_on": {"started_at": "x", "at": 1}}) is None  # unreadable: not exact
    assert recorded_inputs({"judged_on": doc}) == ON


def test_judge_window_is_the_judge_with_the_recorded_inputs() -> None:
    w = CohortWindow("1", "2", START)
    w.add_all(arms(300, -0.08, seed=3))
    policy = JudgePolicy(min_users=20)
    got = judge_window(w, policy, ON)
    stable, canary = w.cohorts(ON.requests, ON.errors, ON.user_errors)  # the plain call
    want = judge(stable, canary, policy, None, elapsed_s=900.0,
                 boundaries=(START, START + 30.0, START + 330.0))
    assert repr(got.verdict) == repr(want)  # (NaN figures: equal reprs, not ==)
    assert got.stable == stable and got.canary == canary
    assert got.canary.errors == 9 and got.canary.user_errors[0].user_key == "canary-u3"
    j = judgement(got.verdict, ON)
    assert j.judged_on == {**ON.to_doc(), "verdict": want.decision.value}


def test_the_window_remembers_how_far_each_partition_was_read() -> None:
    w = CohortWindow("1", "2", START)
    for partition, offset in ((2, 5), (0, 0), (2, 3), (2, 9)):
        w.read(partition, offset)
    assert w.read_to == {0: 1, 2: 10}


def test_status_keeps_the_latest_inputs_across_a_restart() -> None:
    st = CanaryStatus(phase=Phase.PROGRESSING, canary_id="c", judged_on=ON.to_doc())
    again = CanaryStatus.from_json(json.loads(json.dumps(st.to_json())))
    assert JudgedOn.from_doc(again.judged_on) == ON


def test_replay_judges_only_what_the_deployer_had_read() -> None:
    """The deployer read 300 records per arm (a slightly better canary): it decided on those.
    600 much worse canary records of the same window arrived later. Re-judged from the recorded
    inputs the verdict is the deployer's; judged on everything served before the decision it is
    a rollback."""
    early = arms(300, +0.02, seed=11)
    late = [r.model_copy(update={"request_id": f"late-{r.request_id}",
                                 "reward": r.reward - (0.6 if r.arm == "canary" else 0.0)})
            for r in arms(600, 0.0, seed=12)]
    where = {r.request_id: (i % 2, i // 2) for i, r in enumerate(early + late)}
    read_to = {p: 1 + max(o for (q, o) in (where[r.request_id] for r in early) if q == p) for p in (0, 1)}
    policy = JudgePolicy(min_users=20)
    live = CohortWindow("1", "2", START)
    live.add_all(early)
    on = JudgedOn(START, START + 1200.0, (START + 1.0,), read_to=read_to)
    verdict = judge_window(live, policy, on).verdict.decision.value
    assert verdict != "rollback"
    row = {"canary_id": "canary-v2", "candidate": "2", "stable": "1", "outcome": "promoted",
           "started_ms": START * 1000, "decided_at": (T0 + timedelta(seconds=1200)).isoformat(),
           "judged_on": {**on.to_doc(), "verdict": verdict}}
    pairs = [Pair(r, r) for r in early + late]
    [exact] = canaries(pairs, [row], policy, where)
    assert exact["exact"] and exact["reproduces"] and exact["live"]["verdict"] == verdict
    assert exact["live"]["users"] == [150, 150]
    [naive] = canaries(pairs, [row], policy, None)  # no positions: the start alone
    assert not naive["exact"] and naive["reproduces"] is None and naive["live"]["verdict"] == "rollback"
    text = render({"spec": "v2", "live_spec": "v1", "check": {"records": 1, "reproduced": 1},
                   "rewards": {"records": 1, "changed": 0, "sign_flips": 0, "mean_live": 0.0,
                               "mean_replayed": 0.0, "mean_abs_change": 0.0, "by_version_arm": []},
                   "canaries": [exact, naive], "written_to": "x"})
    assert f"the deployer's verdict, {verdict}, reproduced" in text
    assert "judged on its start alone" in text
