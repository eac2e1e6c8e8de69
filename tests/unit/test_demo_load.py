"""``rtrl demo --load N``: busy processes that are bounded (stopped with the demo, gone when
the demo dies, gone after their time limit), and a run that served nothing says so and fails."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from services.demo import run as demo
from services.demo.config import STOP_RESERVE_S, DemoPlan
from services.demo.load import MAX_LOAD, BusyLoad
from services.settings.demo import DemoSettings


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split()[2] == "Z")


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_busy_processes_spin_and_stop_with_the_demo() -> None:
    with BusyLoad(2, max_s=60) as load:
        pids = [p.pid for p in load.procs]
        deadline = time.monotonic() + 30  # on a busy machine a spinner gets less than its core
        while not all(_cpu_s(pid) > 0.2 for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert load.running() == 2
        assert all(_cpu_s(pid) > 0.2 for pid in pids), "each process keeps a core busy"
    assert not any(_alive(pid) for pid in pids)


def test_a_spinner_outlives_neither_a_killed_demo_nor_its_time_limit() -> None:
    script = textwrap.dedent("""
        import os, sys
        from services.demo.load import BusyLoad
        load = BusyLoad(1, max_s=60).start()
        print(load.procs[0].pid, flush=True)
        os._exit(0)  # as if SIGKILLed: nothing stops the spinner
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         timeout=60)
    orphan = int(out.stdout.split()[0])
    deadline = time.monotonic() + 10
    while _alive(orphan) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(orphan), "a spinner whose demo died must exit by itself"
    with BusyLoad(1, max_s=1) as load:
        load.procs[0].wait(timeout=10)  # gives up after max_s, stopped or not
        assert load.running() == 0


@pytest.mark.parametrize("n", [-1, MAX_LOAD + 1])
def test_load_is_bounded(n: int) -> None:
    with pytest.raises(ValueError, match="busy processes"):
        BusyLoad(n, max_s=1)
    with pytest.raises(SystemExit) as exc:
        demo.main(["--load", str(n)])
    assert exc.value.code == 2


def test_a_run_that_served_nothing_says_why(tmp_path: Path) -> None:
    plan = DemoPlan.create(DemoSettings(data_dir=tmp_path / "d", minutes=15), False, "rtrl demo", {})
    never = demo.Run()
    assert not demo.served(never)
    assert "never started" in demo.nothing_served(plan, never)
    late = demo.Run(loop_started=plan.started + 14.5 * 60, summary={"records": 0})
    assert not demo.served(late)
    assert "setup took 14.5 min; the loop had the 15-minute budget" in demo.nothing_served(plan, late)
    assert demo.served(demo.Run(summary={"records": 3}))


def test_the_loop_has_its_own_budget_however_long_the_setup_took(tmp_path: Path) -> None:
    own = DemoPlan.create(DemoSettings(data_dir=tmp_path / "d", loop_minutes=12), False, "rtrl demo", {})
    for setup_s in (40.0, 250.0, 800.0):  # an idle machine, a busy one, a vLLM model build
        assert own.loop_deadline(own.started + setup_s) == pytest.approx(own.started + setup_s + 720.0)
    # 12 minutes of loop, 30 of setup and the 60 s holdout measurement
    assert "loop's own 12 minutes" in own.budget() and own.longest_s() == 60.0 * 42 + 60.0
    whole = DemoPlan.create(DemoSettings(data_dir=tmp_path / "d", minutes=15), False, "rtrl demo", {})
    assert whole.loop_deadline(whole.started + 250.0) == pytest.approx(whole.started + 900.0 - STOP_RESERVE_S)


def test_the_loops_default_budget_is_the_engines_and_a_given_one_wins(tmp_path: Path) -> None:
    def deadline(**kw: object) -> float:
        plan = DemoPlan.create(DemoSettings(data_dir=tmp_path / "d", **kw), False, "rtrl demo", {})
        return plan.loop_deadline(plan.started + 100.0) - (plan.started + 100.0)

    assert deadline() == pytest.approx(12 * 60.0)
    assert deadline(engine="vllm") == pytest.approx(20 * 60.0)  # LoRA increments take minutes each
    assert deadline(engine="vllm", loop_minutes=7) == pytest.approx(7 * 60.0)
    assert deadline(loop_minutes=30) == pytest.approx(30 * 60.0)


@pytest.mark.parametrize("argv", [["--loop-minutes", "0"], ["--minutes", "-1"]])
def test_budgets_must_be_positive(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        demo.main(argv)
    assert exc.value.code == 2
