"""What a reviewer reads in MLflow, by hand: each version's fate through the state machine
(fakes), its description, and the ledger run's description and comparison table."""

from __future__ import annotations

import csv
import io
import itertools
import json

from deployer import ledger, records
from deployer.adapters.memory import FakeWorld
from deployer.status import CanaryPolicy, Command
from ingest.contracts.registry import CHAMPION_SINCE, CHAMPION_SUCCESSOR, CHAMPION_UNTIL, FATE, Tag

POLICY = CanaryPolicy(steps=(0.01, 0.05), bake_s=60, max_duration_s=3600)
_ids = itertools.count()


def world() -> FakeWorld:
    w = FakeWorld(policy=POLICY)
    w.register("1", alias="champion")
    w.register("2", alias="candidate")
    return w


def fate(w: FakeWorld, version: str) -> str | None:
    return w.registry.tags.get(version, {}).get(FATE)


def cmd(kind: str, version: str | None = None) -> Command:
    return Command(id=f"c{next(_ids)}", kind=kind, by="alice", version=version)  # type: ignore[arg-type]


def test_fates_follow_canary_promotion_and_supersession() -> None:
    w = world()
    w.tick()
    assert fate(w, "2") == records.CANARY
    w.tick(), w.tick(commands=(cmd("promote", "2"),))
    assert fate(w, "2") == records.PROMOTED and fate(w, "1") == records.SUPERSEDED
    tags2, tags1 = w.registry.tags["2"], w.registry.tags["1"]
    assert tags2[CHAMPION_SINCE] == tags1[CHAMPION_UNTIL] != ""
    assert tags1[CHAMPION_SUCCESSOR] == "2" and tags2[CHAMPION_SUCCESSOR] == ""
    text = records.version_description("rtrl-policy", "1", tags1)
    assert f"until {tags1[CHAMPION_UNTIL]} (superseded by [v2](#/models/rtrl-policy/versions/2))" in text


def test_a_rolled_back_or_aborted_canary_leaves_its_candidate_rolled_back() -> None:
    w = world()
    w.tick(), w.tick(), w.tick("rollback")
    assert w.phases[-1] == "rolled_back" and fate(w, "2") == records.ROLLED_BACK
    assert fate(w, "1") is None, "the champion is untouched"
    tags = w.registry.tags["2"]
    assert tags[Tag.DECISION_REASON] == "judge: canary worse: judge said rollback"
    assert records.verdict_and_reasons(tags) == ("judge: canary worse", ["judge said rollback"])
    w = world()
    w.tick(), w.tick(), w.tick("inconclusive")
    assert w.phases[-1] == "aborted" and fate(w, "2") == records.ROLLED_BACK


def test_a_restore_by_hand_makes_the_old_version_champion_again() -> None:
    w = world()
    w.tick(), w.tick(), w.tick(commands=(cmd("promote", "2"),))
    w.tick(commands=(cmd("rollback", "1"),))
    assert w.registry.aliases["champion"] == "1"
    assert fate(w, "1") == records.PROMOTED and w.registry.tags["1"][CHAMPION_UNTIL] == ""
    assert fate(w, "2") == records.ROLLED_BACK and w.registry.tags["2"][CHAMPION_UNTIL]
    assert w.registry.tags["2"][CHAMPION_SUCCESSOR] == "1" and w.registry.tags["1"][CHAMPION_SUCCESSOR] == ""
    assert "(replaced by [v1](" in records.version_description("rtrl-policy", "2", w.registry.tags["2"])


WINDOW = json.dumps({"topic": "rtrl.rewards.v1", "ranges": [{"partition": 0, "start": 10, "end": 90}],
                     "records": 77, "id": "abc"})


def test_version_description_says_what_it_is_where_it_came_from_and_its_fate() -> None:
    tags = {Tag.PARENT_VERSION: "6", Tag.KIND: "increment", Tag.WINDOW: WINDOW,
            Tag.REWARD_SPEC_VERSION: "default-3", Tag.GATE_RESULT: "pass", Tag.RUN_ID: "r1",
            "rtrl.canary.id": "canary-v7-x", Tag.CANARY_OUTCOME: "promoted", Tag.DECISION: "promote",
            Tag.DECIDED_BY: "controller", "rtrl.decided_at": "2026-11-22T05:00:00Z",
            Tag.DECISION_REASON: "reward better | all guardrails held",
            FATE: records.PROMOTED, CHAMPION_SINCE: "2026-11-22T05:00:00Z"}
    text = records.version_description("rtrl-policy", "7", tags, records.run_link("3", "r1"),
                                       records.run_link("5", "L1"))
    assert text.startswith("rtrl policy v7: champion")
    assert "trained from [v6](#/models/rtrl-policy/versions/6)" in text
    assert "`rtrl.rewards.v1` offsets p0 10–90; 77 records" in text
    assert "| reward spec | default-3 |" in text and "| offline gate | **pass** |" in text
    assert "[r1](#/experiments/3/runs/r1?workflowType=machine_learning)" in text
    assert "[canary-v7-x](#/experiments/5/runs/L1?workflowType=machine_learning): promoted" in text
    assert "reward better \\| all guardrails held" in text, "a | in a reason cannot break the table"
    assert "| champion | since 2026-11-22T05:00:00Z |" in text and "| fate | `promoted` |" in text
    gate = {Tag.GATE_RESULT: "fail", Tag.GATE_REASONS: json.dumps({"reasons": ["KL to parent 0.9 > 0.5"]})}
    fresh = records.version_description("rtrl-policy", "8", gate)
    assert fresh.startswith("rtrl policy v8: not offered to users")
    assert "**fail**: KL to parent 0.9 > 0.5" in fresh and "canary" not in fresh


METRICS = {"judge.reward.stable_mean": 0.5, "judge.reward.canary_mean": 0.1, "judge.reward.estimate": -0.4,
           "judge.reward.ci_lower": -0.45, "judge.reward.ci_upper": -0.35, "judge.reward.p_value": 0.001,
           "judge.users.canary": 90.0, "cohort.stable.n": 100.0, "cohort.canary.n": 80.0,
           "canary.weight": 0.1}


def test_comparison_has_a_row_per_judged_metric_and_cohort_figure() -> None:
    rows = records.comparison(METRICS)
    assert [(r.metric, r.source) for r in rows] == [("reward", "judge"), ("n", "cohort")]
    assert rows[0].delta == -0.4 and rows[0].ci_lower == -0.45 and rows[0].p_value == 0.001
    assert rows[1].delta == -20.0 and rows[1].ci_lower is None
    table = list(csv.DictReader(io.StringIO(records.comparison_csv(rows))))
    assert table[0] == {"metric": "reward", "source": "judge", "stable": "0.5", "canary": "0.1",
                        "delta": "-0.4", "ci_lower": "-0.45", "ci_upper": "-0.35", "p_value": "0.001"}
    assert table[1]["ci_lower"] == "" and table[1]["delta"] == "-20"


def test_run_description_puts_the_decision_in_words_with_links_and_metric_lines() -> None:
    tags = {"rtrl.candidate_version": "7", "rtrl.stable_version": "6", Tag.CANARY_OUTCOME: "rolled_back",
            Tag.DECISION: "rollback", Tag.DECIDED_BY: "controller", "rtrl.decided_at": "2026-11-22T05:00:00Z",
            Tag.DECISION_REASON: "reward worse", "rtrl.canary.kind": "canary"}
    rows = records.comparison(METRICS)
    text = records.run_description(tags, rows, "rtrl-policy", records.run_link("3", "r1"))
    assert text.startswith("v7 was rolled back: v6 stays the champion.")
    assert "Decided by controller at 2026-11-22T05:00:00Z: reward worse." in text
    assert text.index("reward worse") < text.index("- reward: stable"), "the verdict above the fold"
    assert "candidate [v7](#/models/rtrl-policy/versions/7)" in text
    assert "stable [v6](#/models/rtrl-policy/versions/6)" in text
    assert "[training run](#/experiments/3/runs/r1?workflowType=machine_learning)" in text
    assert ("- reward: stable 0.5, canary 0.1, delta -0.4, always-valid interval [-0.45, -0.35], p 0.001"
            in text)
    running = records.run_description({"rtrl.candidate_version": "7", "rtrl.stable_version": "6"}, [], "m")
    assert running.startswith("The canary of v7 against v6 is running.")


JUDGE_REASONS = ["Edit persistence 50.7% on the canary vs 80.1% on stable (difference -29.3 pts, p=8e-206; "
                 "54 vs 97 users): confidently worse on the canary.",
                 "Acceptance rate 54.0% on the canary vs 97.0% on stable: confidently worse on the canary."]


def test_the_judges_reasons_are_listed_one_per_line_under_a_one_line_verdict() -> None:
    """The reason tag joins the judge's reasons with "; " (and a reason holds "; " itself):
    the pages list them from ``rtrl.decision.reasons`` under the verdict that precedes them."""
    reason = "judge: canary worse: " + "; ".join(JUDGE_REASONS)
    tags = {**ledger.decision_tags("rolled_back", reason, "controller", 0.0, JUDGE_REASONS),
            "rtrl.candidate_version": "7", "rtrl.stable_version": "6"}
    assert records.verdict_and_reasons(tags) == ("judge: canary worse", JUDGE_REASONS)
    run = records.run_description(tags, [], "rtrl-policy")
    assert "Decided by controller at 1970-01-01T00:00:00Z: judge: canary worse.\n\n- Edit persistence" in run
    assert f"- {JUDGE_REASONS[1]}" in run and ".;" not in run
    version = records.version_description("rtrl-policy", "7", tags)
    assert "| decision | rollback by controller at 1970-01-01T00:00:00Z: judge: canary worse |" in version
    assert version.endswith(f"The judge's reasons:\n\n- {JUDGE_REASONS[0]}\n- {JUDGE_REASONS[1]}\n")
    manual = {**tags, Tag.DECISION_REASON: "operator alice: the canary breaks a customer's parser"}
    assert records.verdict_and_reasons(manual) == (manual[Tag.DECISION_REASON], [])
    huge = ledger.decision_tags("rolled_back", "judge: canary worse: x", "controller", 0.0, ["x" * 5000])
    assert Tag.DECISION_REASONS not in huge, "a list too long for a tag is left to the reason alone"


def test_a_decided_ledger_run_is_named_for_its_outcome_and_decider() -> None:
    base = {"rtrl.candidate_version": "7", "rtrl.stable_version": "6", Tag.DECIDED_BY: "alice"}
    assert records.run_title({**base, Tag.CANARY_OUTCOME: "rolled_back"}) == "v7 rolled back by alice"
    assert records.run_title({**base, Tag.CANARY_OUTCOME: "aborted"}) == "v7 aborted by alice"
    restore = {**base, Tag.CANARY_OUTCOME: "promoted", "rtrl.canary.kind": "manual_rollback"}
    assert records.run_title(restore) == "v6 rolled back to v7 by alice"


def test_the_registered_models_description_indexes_every_version_newest_first() -> None:
    versions = [
        ("1", {FATE: records.SUPERSEDED}),
        ("10", {FATE: records.ROLLED_BACK, Tag.DECISION: "rollback", Tag.DECIDED_BY: "controller",
                "rtrl.decided_at": "2026-11-22T05:00:00Z", "rtrl.canary.id": "canary-v10-x"}),
        ("2", {FATE: records.PROMOTED, Tag.DECISION: "promote", Tag.DECIDED_BY: "alice",
               "rtrl.decided_at": "2026-11-21T05:00:00Z", "rtrl.canary.id": "promote-v2-y"}),
        ("11", {}),
    ]
    text = records.model_index("m", "2", versions, {"canary-v10-x": "#/experiments/5/runs/L10"})
    assert text.startswith("rtrl policies. Champion now: [v2](#/models/m/versions/2).")
    rows = [line for line in text.splitlines() if line.startswith("| [v")]
    assert [r.split("]")[0] for r in rows] == ["| [v11", "| [v10", "| [v2", "| [v1"], "newest first"
    assert rows[0] == "| [v11](#/models/m/versions/11) | not offered to users | – | – | – | – |"
    assert rows[1] == ("| [v10](#/models/m/versions/10) | rolled back | rollback | 2026-11-22T05:00:00Z | "
                       "controller | [canary-v10-x](#/experiments/5/runs/L10) |")
    assert rows[2].endswith("| promote | 2026-11-21T05:00:00Z | alice | promote-v2-y |"), "no run: no link"
    many = [(str(v), {}) for v in range(1, records.INDEX_ROWS + 6)]
    long = records.model_index("m", None, many, {})
    assert "Champion now: none yet." in long and "5 older versions: MLflow's versions tab." in long
    assert f"| [v{records.INDEX_ROWS + 5}]" in long and "| [v5](" not in long and "| [v6](" in long


def test_metric_lines_speak_the_units_of_the_judges_reasons() -> None:
    rate = records.Row("persistence", "judge", 0.801, 0.507, -0.294, -0.331, -0.256, 8e-06)
    assert records.metric_line(rate) == ("persistence: stable 80.1%, canary 50.7%, delta -29.4 pts, "
                                         "always-valid interval [-33.1 pts, -25.6 pts], p 8e-06")
    slow = records.Row("latency_ms", "judge", 120.0, 150.5, 30.5, 20.0, 41.0, None)
    assert records.metric_line(slow) == ("latency_ms: stable 120 ms, canary 150 ms, delta +30.5 ms, "
                                         "always-valid interval [+20.0 ms, +41.0 ms]")
