"""Edit persistence means one thing: the demo report, the judge (and its ledger summary) and
the reward compute it through ingest/contracts/metrics.py, at the reward spec's primary
horizon. Here both are computed from one ``rewards.jsonl`` and checked against a hand count."""

from __future__ import annotations

import json
import math
import random
from datetime import UTC, datetime
from pathlib import Path

import pytest

from deployer.cohorts import CohortWindow, summary
from ingest.contracts.metrics import edit_persistence, nearest_horizon, persistence_at, quantile, summarise
from ingest.events import RewardRecord
from ingest.reward.maths import persistence_ratio
from services.report.write import write_report

T = 1_700_000_000.0
HORIZON = 600


def record(i: int, arm: str, version: str, kind: str, accepted: bool | None,
           persistence: dict[str, float]) -> dict[str, object]:
    ts = datetime.fromtimestamp(T + i, UTC).isoformat()
    return {
        "request_id": f"r{i}", "served_event_id": f"e{i}", "session_id": "s", "user_key": f"u{i % 13}",
        "served_ts": ts, "closed_ts": ts, "model": {"name": "m", "version": version}, "arm": arm,
        "prompt_tokens": [1], "completion_tokens": [2, 3], "behavior_logprobs": [-0.1, -0.2],
        "latency_ms": 100.0 + i, "completion_kind": kind, "accepted": accepted, "persistence": persistence,
        "reward": 0.0, "components": {}, "reward_spec_version": "t",
    }


def hostile_mix(seed: int) -> list[dict[str, object]]:
    """Records whose horizons vary: the primary one, only others, none; questions and
    rejected edits that still carry a persistence report (which must not count)."""
    rng = random.Random(seed)
    out = []
    for i in range(400):
        kind = rng.choice(["edit", "edit", "edit", "question", "empty"])
        accepted = rng.choice([True, True, False, None])
        horizons = rng.choice([["30", "600", "3600"], ["30", "3600"], ["3600"], ["30"], [], ["300", "900"]])
        pers = {h: round(rng.random(), 3) for h in horizons}
        arm, version = ("stable", "1") if i % 2 else ("canary", "2")
        out.append(record(i, arm, version, kind, accepted, pers))
    return out


def by_hand(records: list[dict[str, object]], version: str) -> float:
    """The rule in words: accepted edits only; the ratio at 600 s, else at the reported
    horizon nearest to it, the shorter on a tie."""
    vals = []
    for r in records:
        if r["model"]["version"] != version or r["completion_kind"] != "edit" or r["accepted"] is not True:  # type: ignore[index]
            continue
        pers = {int(h): v for h, v in r["persistence"].items()}  # type: ignore[attr-defined]
        if not pers:
            continue
        best = sorted(pers, key=lambda h: (abs(h - HORIZON), h))[0]
        vals.append(pers[best])
    return sum(vals) / len(vals)


@pytest.mark.parametrize("seed", [3, 17, 2024])
def test_the_report_and_the_judge_measure_the_same_persistence(tmp_path: Path, seed: int) -> None:
    records = hostile_mix(seed)
    write_report(tmp_path, records, [], primary_horizon_s=HORIZON, baseline_version="1", final_version=None,
                 bad_version=None, started=T, finished=T + 500, command="test", mlflow_url="")
    back = [json.loads(line) for line in (tmp_path / "rewards.jsonl").read_text().splitlines()]
    doc = json.loads((tmp_path / "summary.json").read_text())
    assert doc["persistence_horizon_s"] == HORIZON
    window = CohortWindow("1", "2", T, horizon_s=HORIZON)
    window.add_all(RewardRecord.model_validate(r) for r in back)
    stable, canary = window.cohorts()
    for version, cohort in (("1", stable), ("2", canary)):
        judged = summary(cohort)["persistence"]
        reported = doc["cohorts"][version]["edit_persistence"]
        assert judged == pytest.approx(reported, rel=1e-12)
        assert judged == pytest.approx(by_hand(back, version), rel=1e-12)
    assert "judge decides on" in (tmp_path / "report.md").read_text()


def test_nearest_horizon_prefers_the_exact_then_the_nearer_then_the_shorter() -> None:
    assert nearest_horizon([30, 600, 3600], 600) == 600
    assert nearest_horizon([30, 3600], 600) == 30
    assert nearest_horizon([300, 900], 600) == 300
    assert nearest_horizon([], 600) is None


def test_only_accepted_edits_have_a_persistence() -> None:
    assert edit_persistence("edit", True, {"600": 0.5}, 600) == 0.5
    assert edit_persistence("edit", False, {"600": 0.5}, 600) is None
    assert edit_persistence("edit", None, {"600": 0.5}, 600) is None
    assert edit_persistence("question", True, {"600": 0.5}, 600) is None
    assert edit_persistence("edit", True, {}, 600) is None
    assert persistence_at({"600": 1.7, "30": -0.2}, 600) == 1.0


def test_the_reward_uses_the_same_horizon_rule() -> None:
    chars = {30: (9, 10), 3600: (1, 10)}  # no 600 s report: the nearer 30 s one counts
    assert persistence_ratio(chars, 600) == pytest.approx(0.9)
    assert persistence_ratio(chars, 600) == persistence_at({h: r / i for h, (r, i) in chars.items()}, 600)


def test_quantile_matches_linear_interpolation() -> None:
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert quantile(xs, 0.5) == 3.0
    assert quantile(xs, 0.95) == pytest.approx(4.8)
    assert math.isnan(quantile([], 0.5))
    assert summarise([]).n == 0 and math.isnan(summarise([]).edit_persistence)
