"""The demo's orchestration pieces and the report maths (no network)."""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from ingest.contracts.metrics import persistence_at
from ingest.reward.spec import default_spec_text, parse_spec
from services.demo.config import (
    MARKER,
    demo_spec_text,
    demo_trainer_env,
    prepare_data_dir,
    service_env,
    write_corpus,
)
from services.report.cohorts import (
    Cohort,
    Row,
    Targets,
    by_version,
    cohort,
    compare,
    relative_change,
    row_from_record,
    series,
)
from services.report.markdown import render_markdown
from services.report.sources import Decision
from services.report.write import write_report
from services.settings.demo import DemoSettings
from services.settings.model import Settings, settings_from_env
from services.stack.supervisor import ProcSpec, RewardsTracker, Supervisor
from trainer.tokens import EOS


def test_demo_spec_is_a_valid_spec_with_its_own_version() -> None:
    spec = parse_spec(demo_spec_text(default_spec_text()), "demo")
    base = parse_spec(default_spec_text())
    assert spec.version == "demo-v3-n1" and spec.version != base.version
    assert spec.no_edit.question == spec.no_edit.empty == 1.0 and base.no_edit.question == 0.0
    assert spec.persistence == base.persistence and spec.acceptance == base.acceptance
    assert spec.window.followup_s == 600 and spec.latency.slo_ms == 400


def test_corpus_lines_are_prompt_and_mediocre_completion(tmp_path: Path) -> None:
    path = write_corpus(tmp_path / "c.jsonl", seed=1, n=50)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 50
    for r in rows:
        assert r["prompt"][0] == 0 and r["completion"][-1] == EOS
        assert len(r["completion"]) >= 8  # long-ish: ideal length plus 5..9 extra


def test_service_env_is_read_back_by_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = service_env(DemoSettings(), tmp_path, {"RTRL_KAFKA__BOOTSTRAP_SERVERS": "127.0.0.1:1"}, 4321,
                      {"gateway": "a", "simulator": "b"}, tmp_path / "spec.toml")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    s = Settings()
    assert s.gateway.port == 4321 and s.simulator.gateway_url == "http://127.0.0.1:4321"
    assert s.reward.time_scale == s.simulator.time_scale == DemoSettings().time_scale
    assert s.auth.keys["simulator"].get_secret_value() == "b"
    assert s.deployer.steps == (0.1, 0.25, 0.5)
    assert s.trainer.interval_s == DemoSettings().trainer_cadence_s
    assert s.deployer.max_duration_s == 420 and s.deployer.min_bake_s == 6


def test_the_demos_steady_step_fits_inside_the_gate_and_under_the_length_detector(tmp_path: Path) -> None:
    """The demo's band is live in the services' settings and in the offline bench's defaults;
    a step inside it passes the gate, and its length guard trips before the canary's length
    detector would."""
    from bench.loop_offline import parser
    from rollback.types import DetectorPolicy
    from services.demo.engine import engine_env

    env = service_env(DemoSettings(), tmp_path, {}, 4321, {"gateway": "a", "simulator": "b"},
                      tmp_path / "spec.toml")
    trainer = settings_from_env(env).trainer
    band = trainer.band
    assert band.enabled and band.low < (band.target or 0) < band.high <= trainer.gate.max_kl
    assert band.max_length_change is not None
    assert band.max_length_change < DetectorPolicy().length_change
    assert trainer.warmup_steps > 0 and trainer.lr == settings_from_env(demo_trainer_env()).trainer.lr
    env.update(engine_env(tmp_path, 1234))  # the LoRA demo learns at its own, measured pace
    lora = settings_from_env(env).trainer
    assert lora.warmup_steps == 0 and lora.band.low == 1.0
    assert lora.band.max_length_change == band.max_length_change  # within the length detector's tolerance
    assert lora.band.target == band.target and lora.lr > trainer.lr
    bench = parser().parse_args([])
    assert bench.kl_band == f"{band.low:g}:{band.high:g}:{band.target:g}"
    assert float(bench.length_guard) == band.max_length_change and bench.warmup == trainer.warmup_steps
    agent_env = service_env(DemoSettings(agent=True), tmp_path, {}, 4321, {"gateway": "a", "simulator": "b"},
                            tmp_path / "spec.toml")
    agent = settings_from_env(agent_env).trainer
    agent_env.update(engine_env(tmp_path, 1234, agent=True))  # the agent's LoRA steps: its band, slowly
    agent_lora = settings_from_env(agent_env).trainer
    assert (agent_lora.band.low, agent_lora.band.high, agent_lora.band.target) == \
        (agent.band.low, agent.band.high, agent.band.target)
    assert agent_lora.band.max_length_change is None and agent_lora.warmup_steps == 0
    assert agent.lr < agent_lora.lr < lora.lr


@pytest.mark.parametrize(("engine", "agent", "setting", "expected"), [
    ("vllm", False, None, True),     # the one-shot vLLM demo promotes improvements only
    ("vllm", True, None, False),     # the agent and built-in demos promote "no worse"
    ("builtin", False, None, False),
    ("vllm", False, False, False),   # the setting wins either way
    ("builtin", False, True, True),
])
def test_the_demo_promotes_on_an_improvement_on_vllm_unless_told(
        tmp_path: Path, engine: str, agent: bool, setting: bool | None, expected: bool) -> None:
    from services.demo.engine import engine_env
    from services.wiring.deployer import judge_policy

    demo = DemoSettings(engine=engine, agent=agent, require_improvement=setting)
    env = service_env(demo, tmp_path, {}, 4321, {"gateway": "a", "simulator": "b"}, tmp_path / "spec.toml")
    if engine == "vllm":
        env.update(engine_env(tmp_path, 1234, demo.canary_max_s, agent=agent))
    assert judge_policy(settings_from_env(env).deployer, sessions=agent).require_improvement is expected


@pytest.mark.parametrize(("engine", "canary_max_s", "expected"),
                         [("builtin", None, 420.0), ("builtin", 90.0, 90.0), ("vllm", None, 600.0),
                          ("vllm", 120.0, 120.0)])
def test_a_canarys_longest_run_is_the_engines_default_or_the_setting(
        tmp_path: Path, engine: str, canary_max_s: float | None, expected: float) -> None:
    from services.demo.engine import engine_env

    demo = DemoSettings(engine=engine, canary_max_s=canary_max_s)
    env = service_env(demo, tmp_path, {}, 4321, {"gateway": "a", "simulator": "b"}, tmp_path / "spec.toml")
    if engine == "vllm":
        env.update(engine_env(tmp_path, 1234, demo.canary_max_s))
    assert settings_from_env(env).deployer.max_duration_s == expected


def test_settings_from_env_read_the_mapping_as_a_process_would_and_not_os_environ(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the demo's own process reads, without touching os.environ: the same Settings its
    services get from the same environment."""
    env = service_env(DemoSettings(), tmp_path, {"RTRL_REDIS__URL": "redis://127.0.0.1:1/0"}, 4321,
                      {"gateway": "a", "simulator": "b"}, tmp_path / "spec.toml")
    parent = {"RTRL_MLFLOW__REGISTERED_MODEL": "mine", "RTRL_GATEWAY__PORT": "1", "PATH": "/bin"}
    monkeypatch.setenv("RTRL_TOPICS__REWARDS", "not-read")
    before = dict(os.environ)
    s = settings_from_env({**parent, **env})
    assert dict(os.environ) == before
    assert s.gateway.port == 4321 and s.mlflow.registered_model == "mine" and s.topics.rewards != "not-read"
    assert s.redis.url.get_secret_value() == "redis://127.0.0.1:1/0" and s.deployer.steps == (0.1, 0.25, 0.5)
    monkeypatch.delenv("RTRL_TOPICS__REWARDS")
    for k, v in {**parent, **env}.items():
        monkeypatch.setenv(k, v)
    assert s == Settings()


def test_prepare_data_dir_wipes_only_demo_directories(tmp_path: Path) -> None:
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "precious.txt").write_text("x")
    with pytest.raises(SystemExit, match="not made by rtrl demo"):
        prepare_data_dir(foreign)
    assert (foreign / "precious.txt").exists()
    demo = tmp_path / "demo"
    prepare_data_dir(demo)
    (demo / "old.log").write_text("x")
    prepare_data_dir(demo)
    assert (demo / MARKER).exists() and not (demo / "old.log").exists()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return True


def test_supervisor_stops_services_and_their_children(tmp_path: Path) -> None:
    """A service that ignores SIGTERM and has a child of its own: both are gone after stop_all."""
    script = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(tmp_path / 'child.pid')!r}, 'w').write(str(child.pid))\n"
        "time.sleep(60)\n"
    )
    sup = Supervisor(tmp_path / "logs", {"X_DEMO": "1"})
    stubborn = sup.start(ProcSpec("stubborn", [sys.executable, "-c", script]))
    polite = sup.start(ProcSpec("polite", [sys.executable, "-c", "import time; time.sleep(60)"]))
    deadline = time.monotonic() + 10
    while not (tmp_path / "child.pid").exists() or not (tmp_path / "child.pid").read_text():
        assert time.monotonic() < deadline  # the file is there before its pid is written
        time.sleep(0.05)
    child = int((tmp_path / "child.pid").read_text())
    codes = sup.stop_all(grace_s=1.0)
    assert codes["polite"] == -signal.SIGTERM
    assert codes["stubborn"] == -signal.SIGKILL
    assert not _alive(stubborn.pid) and not _alive(polite.pid)
    deadline = time.monotonic() + 5
    while _alive(child):
        assert time.monotonic() < deadline, "grandchild survived"
        time.sleep(0.05)


def test_supervisor_stops_a_stage_together_and_stages_in_order(tmp_path: Path) -> None:
    """Two services that each take 1.5 s to stop on SIGTERM, in one stage: together well under
    2 x 1.5 s; the stage after them is only signalled once both have exited."""
    slow = ("import signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *_: (time.sleep(1.5), sys.exit(0)))\n"
            "time.sleep(60)\n")
    stamp = ("import signal, sys, time\n"
             f"signal.signal(signal.SIGTERM, lambda *_: (open({str(tmp_path / 'last.t')!r}, 'w')"
             ".write(repr(time.time())), sys.exit(0)))\n"
             "time.sleep(60)\n")
    sup = Supervisor(tmp_path / "logs")
    for name in ("a", "b"):
        sup.start(ProcSpec(name, [sys.executable, "-c", slow]))
    sup.start(ProcSpec("last", [sys.executable, "-c", stamp]))
    time.sleep(1.0)  # let the interpreters install their handlers
    t0 = time.time()
    codes = sup.stop_all(grace_s=10.0, order=[("a", "b"), "last"])
    assert codes == {"a": 0, "b": 0, "last": 0}
    signalled_last = float((tmp_path / "last.t").read_text())
    assert signalled_last - t0 >= 1.4  # after the stage before it had stopped
    assert signalled_last - t0 < 2.6  # a and b stopped at the same time, not one after the other


def test_supervisor_reports_exits_once_and_runs_one_shots(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path / "logs")
    sup.start(ProcSpec("quick", [sys.executable, "-c", "print('bye'); raise SystemExit(3)"]))
    time.sleep(1.0)
    assert sup.newly_exited() == {"quick": 3}
    assert sup.newly_exited() == {}
    assert "bye" in sup.log_tail("quick")
    assert sup.run(ProcSpec("once", [sys.executable, "-c", "pass"]), timeout_s=20) == 0
    with pytest.raises(TimeoutError, match="did not finish"):
        sup.run(ProcSpec("slow", [sys.executable, "-c", "import time; time.sleep(30)"]), timeout_s=0.5)


def _record(version: str, arm: str, served: float, accepted: bool | None, ratio: float | None,
            latency: float, reward: float, kind: str = "edit", dissatisfied: int = 0) -> dict[str, object]:
    return {
        "served_ts": datetime.fromtimestamp(served, UTC).isoformat(),
        "model": {"name": "m", "version": version},
        "arm": arm, "completion_kind": kind, "accepted": accepted,
        "persistence": {} if ratio is None else {"30": 1.0, "600": ratio, "3600": ratio / 2},
        "latency_ms": latency, "reward": reward, "dissatisfied": dissatisfied,
    }


def test_primary_persistence_uses_the_nearest_horizon() -> None:
    assert persistence_at({"30": 1.0, "600": 0.5}, 600) == 0.5
    assert persistence_at({"30": 1.0, "3600": 0.2}, 600) == 1.0
    assert persistence_at({"3600": 0.2}, 600) == 0.2
    assert persistence_at({}, 600) is None


def test_cohort_hand_computed() -> None:
    t = 1_700_000_000.0
    rows = [row_from_record(r, 600) for r in (
        _record("1", "stable", t, True, 0.8, 100, 1.0),
        _record("1", "stable", t, True, 0.4, 200, 0.5),
        _record("1", "stable", t, False, None, 300, -0.25),
        _record("1", "stable", t, None, None, 50, 0.0, kind="question"),
    )]
    c = cohort(rows)
    assert c.n == 4 and c.n_persistence == 2
    assert c.edit_persistence == pytest.approx(0.6)
    assert c.latency_ms == pytest.approx(162.5)
    assert c.latency_p95_ms == pytest.approx(285)  # linear interpolation: 200 + 0.85 * (300 - 200)
    assert c.reward == pytest.approx(0.3125)
    assert c.acceptance == pytest.approx(2 / 3)
    assert c.edit_rate == pytest.approx(0.75) and c.question_rate == pytest.approx(0.25)
    assert math.isnan(cohort([]).edit_persistence)


def test_relative_change_and_targets() -> None:
    assert relative_change(0.5, 0.6) == pytest.approx(0.2)
    assert relative_change(200, 170) == pytest.approx(-0.15)
    assert math.isnan(relative_change(0, 1)) and math.isnan(relative_change(math.nan, 1))
    t = 1_700_000_000.0
    rows = [row_from_record(r, 600) for r in (
        _record("1", "stable", t, True, 0.5, 200, 0.1), _record("3", "canary", t, True, 0.6, 170, 0.3))]
    cmp = compare(by_version(rows), "1", "3")
    assert cmp.persistence_change == pytest.approx(0.2) and cmp.persistence_ok
    assert cmp.latency_change == pytest.approx(-0.15) and cmp.latency_ok
    worse = compare(by_version(rows), "3", "1")
    assert not worse.persistence_ok and not worse.latency_ok
    assert math.isnan(cmp.dissatisfied_change) and not cmp.dissatisfied_ok, "no follow-up on either side"


def test_dissatisfied_follow_ups_are_the_third_figure() -> None:
    t = 1_700_000_000.0
    # v1: 2 of 8 dissatisfied (25%); v3: 1 of 5 (20%), a relative change of -20%
    rows = [row_from_record(_record("1", "stable", t, True, 0.5, 200, 0.1, dissatisfied=int(i < 2)), 600)
            for i in range(8)]
    rows += [row_from_record(_record("3", "canary", t, True, 0.6, 170, 0.3, dissatisfied=int(i < 1)), 600)
             for i in range(5)]
    cmp = compare(by_version(rows), "1", "3")
    assert cmp.dissatisfied_change == pytest.approx(-0.2) and cmp.dissatisfied_ok
    back = compare(by_version(rows), "3", "1")
    assert back.dissatisfied_change == pytest.approx(0.25) and not back.dissatisfied_ok
    assert compare(by_version(rows), "1", "3", Targets(dissatisfied_up=-0.25)).dissatisfied_ok is False
    assert Targets().dissatisfied_ok(0.0) and not Targets().dissatisfied_ok(math.nan)


def test_series_bins_per_version_and_arm() -> None:
    t = 1_700_000_000.0
    rows = [row_from_record(_record("2", arm, t + dt, True, 0.5, lat, 0.0), 600)
            for arm, dt, lat in (("stable", 1, 100), ("stable", 2, 300), ("canary", 31, 50))]
    s = series(rows, t, 30.0, "latency_ms")
    assert s[("2", "stable")] == [(0.25, 200.0)]
    assert s[("2", "canary")] == [(0.75, 50.0)]


def test_tracker_keeps_records_and_recent_cohorts() -> None:
    tr = RewardsTracker(Settings(), 600)
    now = time.time()
    tr.add_bytes(json.dumps(_record("1", "stable", now - 5, True, 0.5, 100, 1.0)).encode())
    tr.add_bytes(json.dumps(_record("2", "canary", now - 500, True, 0.5, 100, 1.0)).encode())
    tr.add_bytes(b"not json")
    assert tr.count() == 2
    recent = tr.recent(60.0, now)
    assert set(recent) == {("1", "stable")} and recent[("1", "stable")].n == 1


def _decision(cand: str, outcome: str, reason: str, ts: float) -> Decision:
    return Decision(f"canary-v{cand}", cand, "1", outcome, reason, "controller",
                    datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), ts - 60,
                    url="http://mlflow/#/x", evidence={"cohort.canary.reward": 0.3})


def test_write_report_states_targets_bad_candidate_and_plots(tmp_path: Path) -> None:
    t = 1_700_000_000.0
    recs = []
    for i in range(40):
        recs.append(_record("1", "stable", t + i, True, 0.4, 250, 0.1, dissatisfied=int(i % 4 == 0)))
        recs.append(_record("2", "canary", t + 100 + i, True, 0.5, 200, 0.3, dissatisfied=int(i % 8 == 0)))
        recs.append(_record("3", "canary", t + 200 + i, None, None, 40, -0.3, kind="question"))
    decisions = [_decision("2", "promoted", "judge: canary at least as good", t + 150),
                 _decision("3", "rolled_back", "judge: canary worse: edit_rate drift", t + 250)]
    path = write_report(tmp_path / "r", recs, decisions, primary_horizon_s=600, baseline_version="1",
                        final_version="2", bad_version="3", started=t, finished=t + 300,
                        command="rtrl demo --minutes 5", mlflow_url="http://mlflow",
                        kinds={"1": "bootstrap", "2": "increment", "3": "reward-hacked"})
    md = path.read_text()
    assert "+25.0%" in md and "-20.0%" in md and "**not met**" not in md
    assert "| dissatisfied follow-ups | 0.250 | 0.125 | -50.0% |" in md
    assert "rolled back automatically" in md and "edit_rate drift" in md
    assert "[canary-v3](http://mlflow/#/x)" in md and "http://mlflow" in md
    for png in ("edit_persistence.png", "latency_ms.png", "reward.png"):
        assert (tmp_path / "r" / png).stat().st_size > 1000
        assert f"]({png})" in md
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["comparison"]["persistence_ok"] and summary["records"] == 120
    assert summary["comparison"]["dissatisfied_change"] == pytest.approx(-0.5)
    assert summary["comparison"]["dissatisfied_ok"]


def test_markdown_without_promotion_says_so() -> None:
    md = render_markdown(title="t", command="c", started=0, finished=60, cohorts=by_version([]),
                         comparison=None, decisions=[], bad_version="4", mlflow_url="u", plots=[])
    assert "no before/after comparison" in md and "no decision in the ledger" in md


def test_rows_keep_version_and_arm() -> None:
    row = row_from_record(_record("7", "canary", 1.0, False, None, 10, -0.25), 600)
    assert row == Row(1.0, "7", "canary", "edit", False, None, 10.0, -0.25, 0)


def test_leftovers_of_a_killed_run_are_stopped_from_the_pid_file(tmp_path: Path) -> None:
    from services.stack.supervisor import stop_recorded

    sup = Supervisor(tmp_path / "logs", pid_file=tmp_path / "pids.json")
    proc = sup.start(ProcSpec("orphan", [sys.executable, "-c", "import time; time.sleep(60)"]))
    assert json.loads((tmp_path / "pids.json").read_text()) == {"orphan": proc.pid}
    assert stop_recorded(tmp_path / "pids.json") == ["orphan"]
    proc.wait(timeout=5)
    assert proc.returncode == -signal.SIGKILL and not (tmp_path / "pids.json").exists()
    assert stop_recorded(tmp_path / "pids.json") == []


def test_side_by_side_uses_only_the_canary_window() -> None:
    from services.report.cohorts import side_by_side

    t = 1_700_000_000.0
    rows = [row_from_record(r, 600) for r in (
        _record("1", "stable", t - 100, True, 0.1, 900, 0.0),   # before the canary: ignored
        _record("1", "stable", t + 10, True, 0.4, 300, 0.0),
        _record("2", "canary", t + 20, True, 0.6, 200, 0.0),
        _record("2", "stable", t + 500, True, 0.9, 100, 0.0),   # after: ignored
    )]
    st, ca = side_by_side(rows, "1", "2", t, t + 60)
    assert (st.n, ca.n) == (1, 1)
    assert st.edit_persistence == pytest.approx(0.4) and ca.latency_ms == pytest.approx(200)


def test_chain_compounds_side_by_side_changes_along_the_lineage() -> None:
    from services.report.cohorts import chain_comparison

    t = 1_700_000_000.0

    def co(persist: float, latency: float, dissatisfied: float = 0.5) -> Cohort:
        # two rows: dissatisfied in 0, 1 or 2 of them
        rows = [_record("x", "stable", t, True, persist, latency, 0.0, dissatisfied=int(i < 2 * dissatisfied))
                for i in range(2)]
        return cohort([row_from_record(r, 600) for r in rows])

    steps = [("1", "4", co(0.50, 600), co(0.55, 540)),     # +10% persistence, -10% latency
             ("1", "9", co(0.50, 600), co(0.10, 900)),     # a later branch from v1 is ignored
             ("4", "5", co(0.40, 800), co(0.42, 760))]     # +5%, -5% (other minutes, other load)
    chain = chain_comparison(steps, "1", "5")
    assert chain is not None and chain.versions == ("1", "4", "5")
    assert chain.persistence_change == pytest.approx(1.10 * 1.05 - 1)
    assert chain.latency_change == pytest.approx(0.90 * 0.95 - 1)
    assert chain.persistence_ok and chain.latency_ok
    assert chain.dissatisfied_change == pytest.approx(0.0) and chain.dissatisfied_ok
    worse = chain_comparison([("1", "4", co(0.5, 600, 0.5), co(0.55, 540, 1.0))], "1", "4")
    assert worse is not None and worse.dissatisfied_change == pytest.approx(1.0) and not worse.dissatisfied_ok
    unmeasurable = chain_comparison([("1", "4", co(0.5, 600, 0.0), co(0.55, 540, 0.5))], "1", "4")
    assert unmeasurable is not None and unmeasurable.persistence_ok, "the other figures still stand"
    assert math.isnan(unmeasurable.dissatisfied_change) and not unmeasurable.dissatisfied_ok
    assert chain_comparison(steps, "1", "7") is None, "no lineage to v7"
    assert chain_comparison(steps, "1", "1") is None
    empty = cohort([])
    assert chain_comparison([("1", "4", empty, co(0.5, 500))], "1", "4") is None, "an arm unmeasured"
    short = chain_comparison(steps[:1], "1", "4")
    assert short is not None and short.versions == ("1", "4")
    assert short.persistence_change == pytest.approx(0.10)
