"""The demo's run with fakes (no stack, no processes): the bad candidate's life, the watch
loop's arithmetic, and the end that always follows the phases."""

from __future__ import annotations

import math
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from deployer.adapters.memory import InMemoryRegistry
from ingest.contracts.registry import CANDIDATE, Tag
from services.demo import run as demo
from services.demo.config import DemoPlan
from services.demo.inject import BASELINE_REWARDS, MAX_BAD_TRIES, BadCandidateInjector
from services.demo.watch import holdout_until, increments_decided, progress_line
from services.report.cohorts import Cohort
from services.settings.demo import DemoSettings
from services.sim.users import World, make_world

QUIET = {"phase": "idle"}


def _policy(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "policy.json").write_text('{"kind": "tiny-transformer"}')
    return path


def _build(kind: str, champion_dir: Path, out_dir: Path, world: World, seed: int) -> Path:
    assert (champion_dir / "policy.json").exists()
    return _policy(out_dir)


def _injector(tmp_path: Path, **settings: Any) -> tuple[BadCandidateInjector, InMemoryRegistry]:
    reg = InMemoryRegistry(tmp_path / "registry")
    reg.set_alias("champion", reg.register(None, _policy(tmp_path / "v1"), {Tag.KIND: "bootstrap"}))
    bad = BadCandidateInjector(DemoSettings(**settings), tmp_path / "bad", make_world(0), lambda: reg,
                               nullcontext(), build=_build)
    return bad, reg


def test_bad_candidate_waits_for_a_quiet_loop_and_a_baseline(tmp_path: Path) -> None:
    bad, reg = _injector(tmp_path, bad_candidate_after_decisions=1)
    bad.step(QUIET, {}, BASELINE_REWARDS)
    assert bad.version is None, "not before the first decision"
    bad.step({"phase": "progressing"}, {"7": "promoted"}, BASELINE_REWARDS)
    assert bad.version is None, "not while a canary runs"
    bad.step(QUIET, {"7": "promoted"}, BASELINE_REWARDS - 1)
    assert bad.version is None, "not before the champion's baseline"
    bad.step(QUIET, {"7": "promoted"}, BASELINE_REWARDS)
    assert bad.version == "2" and bad.offered and reg.alias_version(CANDIDATE) == "2"
    assert reg.get_tags("2")[Tag.KIND] == "reward-hacked" and reg.get_tags("2")[Tag.PARENT_VERSION] == "1"
    assert reg.get_tags("2")[Tag.POLICY_KIND] == "tiny-transformer", "it says what it is, like any version"
    assert bad.kinds() == {"2": "reward-hacked"} and not bad.done({"7": "promoted"})
    assert bad.done({"7": "promoted", "2": "rolled_back"})


def test_bad_candidate_waits_while_an_increment_holds_the_alias(tmp_path: Path) -> None:
    bad, reg = _injector(tmp_path)
    reg.set_alias(CANDIDATE, reg.register(None, _policy(tmp_path / "inc"), {Tag.KIND: "increment"}))
    bad.step(QUIET, {}, BASELINE_REWARDS)
    assert bad.version == "3" and not bad.offered and reg.alias_version(CANDIDATE) == "2"
    reg.set_tags("2", {Tag.CANARY_OUTCOME: "promoted"})
    bad.step(QUIET, {"2": "promoted"}, BASELINE_REWARDS)
    assert bad.offered and reg.alias_version(CANDIDATE) == "3" and bad.tries == ["3"], "offered, not rebuilt"


def test_an_aborted_bad_candidate_is_replaced_up_to_the_limit(tmp_path: Path) -> None:
    bad, reg = _injector(tmp_path)
    decided: dict[str, str] = {}
    for _ in range(MAX_BAD_TRIES + 1):
        bad.step(QUIET, decided, BASELINE_REWARDS)
        assert bad.version is not None
        if bad.version in decided:
            break
        assert not bad.done(decided)
        reg.set_tags(bad.version, {Tag.CANARY_OUTCOME: "aborted"})
        decided[bad.version] = "aborted"
    assert len(bad.tries) == MAX_BAD_TRIES and bad.done(decided)
    assert bad.kinds() == dict.fromkeys(bad.tries, "reward-hacked")


def test_no_bad_candidate_asked_for() -> None:
    bad = BadCandidateInjector(DemoSettings(bad_candidate="none"), Path("/nonexistent"), make_world(0),
                               lambda: pytest.fail("the registry is not needed"), nullcontext())
    bad.step(QUIET, {}, 10 * BASELINE_REWARDS)
    assert bad.version is None and bad.done({})


def test_increments_decided_leave_out_the_bad_candidates() -> None:
    decided = {"2": "rolled_back", "3": "promoted", "4": "aborted", "5": "rolled_back"}
    assert increments_decided(decided, ["2"], until_promoted=False) == 3
    assert increments_decided(decided, ["2"], until_promoted=True) == 1


def test_progress_line() -> None:
    c = Cohort(n=12, edit_persistence=0.5, latency_ms=210.4, latency_p95_ms=300.0, reward=0.25,
               acceptance=0.5, edit_rate=0.75, question_rate=0.0, dissatisfied_rate=0.0, n_persistence=3)
    few = Cohort(**{**c.__dict__, "n": 4})
    line = progress_line(125.0, None, {"phase": "progressing"},
                         {"stable_version": "3", "canary_version": "4", "canary_weight": "0.25"},
                         {("3", "stable"): c, ("4", "canary"): few}, {"2": "promoted"}, 99)
    assert line == ("2:05 phase=progressing champion=v3 candidate=v4 @25% | stable v3: n=12 persist=0.50 "
                    "lat=210ms reward=0.25 edits=75% | decided: v2 promoted | rewards=99")
    nan = Cohort(**{**c.__dict__, "edit_persistence": math.nan})
    assert "persist=- " in progress_line(0.0, "1", {}, {}, {("1", "stable"): nan}, {}, 0)


class _Stack:
    mlflow_uri = "http://mlflow"
    data_dir = Path("/stack")

    def env(self) -> dict[str, str]:
        return {"RTRL_KAFKA__BOOTSTRAP_SERVERS": "127.0.0.1:1"}


def test_the_end_follows_an_interrupted_run_and_stops_what_was_started(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM in the watch loop: services stopped, tracker stopped, report written with the
    bootstrap and the note, Redis closed, stack stopped; in that order; exit code 130."""
    events: list[str] = []
    reg = InMemoryRegistry(tmp_path / "registry")
    live = SimpleNamespace(
        supervisor="sup", world=make_world(0), registry=lambda: reg, redis=SimpleNamespace(
            close=lambda: events.append("redis closed")),
        tracker=SimpleNamespace(stop=lambda: events.append("tracker stopped"), snapshot=lambda: []))

    def interrupted(*_: Any) -> None:
        events.append("watching")
        raise demo.DemoInterruptError("signal 15")

    def report(report_dir: Path, records: Any, decisions: Any, **kw: Any) -> Path:
        events.append("report")
        assert kw["baseline_version"] == "1" and kw["kinds"] == {"1": "bootstrap"}
        assert kw["notes"] == ["The run was interrupted before its planned end."]
        report_dir.mkdir(parents=True)
        (report_dir / "summary.json").write_text('{"comparison": null, "chain": null}')
        return report_dir / "report.md"

    monkeypatch.setattr(demo, "new_stack", lambda data: _Stack())
    monkeypatch.setattr(demo, "start_stack", lambda stack: events.append("stack up"))
    monkeypatch.setattr(demo, "connect", lambda plan, config: live)
    monkeypatch.setattr(demo, "bootstrap", lambda live, corpus, notes, args: "1")
    monkeypatch.setattr(demo, "pin_holdout", lambda live, config, version, share: events.append(
        f"holdout v{version} {share:g}" + (" signed" if config.operator_token else "")))
    monkeypatch.setattr(demo, "start_services", lambda sup, port, notes: events.append("services"))
    monkeypatch.setattr(demo, "candidate_lock", lambda client, prefix: nullcontext())
    monkeypatch.setattr(demo, "watch", interrupted)
    monkeypatch.setattr(demo, "read_rewards", lambda settings: [])
    monkeypatch.setattr(demo, "read_decisions", lambda settings: [])
    monkeypatch.setattr(demo, "write_report", report)
    monkeypatch.setattr(demo, "stop_services", lambda sup: events.append(f"stop {sup}"))
    monkeypatch.setattr(demo, "stop_stack", lambda stack, keep: events.append(f"stack down keep={keep}"))
    settings = DemoSettings(data_dir=tmp_path / "demo", report_dir=tmp_path / "reports")
    run = demo.Run()
    code = demo.execute(DemoPlan.create(settings, False, "rtrl demo", {"RTRL_REDIS__KEY_PREFIX": "x:"}), run)
    assert code == 130
    doc = run.document(code)  # what --json prints
    assert doc["exit_code"] == 130 and doc["report"].endswith("report.md") and doc["bootstrap_version"] == "1"
    assert doc["summary"] == {"comparison": None, "chain": None} and doc["chaos"] is None
    assert doc["notes"] == ["The run was interrupted before its planned end."]
    assert events == ["stack up", "holdout v1 0.15 signed", "services", "watching", "stop sup",
                      "tracker stopped", "report", "redis closed", "stack down keep=False"]
    assert {"reward-spec.toml", "bootstrap-corpus.jsonl", "operator-keys", "operator.token"} <= {
        p.name for p in (tmp_path / "demo").iterdir()}
    assert (tmp_path / "demo" / "operator.token").stat().st_mode & 0o077 == 0


@pytest.mark.parametrize(("settings", "deadline", "until"), [
    ({}, 0.0, 1060.0),  # the built-in policy's 60 s, after the loop's own minutes
    ({"engine": "vllm"}, 0.0, 1300.0),  # 300 s on vLLM
    ({"holdout_measure_s": 90.0}, 0.0, 1090.0),
    ({"minutes": 20.0}, 1030.0, 1030.0),  # a whole-run budget ends it
    ({"minutes": 20.0}, 2000.0, 1060.0),
    ({"minutes": 20.0}, 900.0, None),  # nothing left of the budget
    ({"holdout_measure_s": 0.0}, 0.0, None),
    ({"holdout_share": 0.0}, 0.0, None),  # no holdout, nothing to measure
])
def test_the_holdout_measurement_has_a_length_fixed_before_the_run(
        settings: dict[str, Any], deadline: float, until: float | None) -> None:
    assert holdout_until(DemoSettings(**settings), deadline, now=1000.0) == until


@pytest.mark.parametrize(("settings", "users"), [
    ({}, 300), ({"engine": "vllm"}, 1000), ({"engine": "vllm", "agent": True}, 300),
    ({"engine": "vllm", "sim_users": 500}, 500), ({"sim_users": 40}, 40)])
def test_the_demos_users_are_the_engines_default_or_the_setting(settings: dict[str, Any], users: int) -> None:
    assert DemoSettings(**settings).simulated_users() == users
