"""What the e2e tests of ``rtrl demo`` share: running it as a user would, and checking that
nothing it started outlived it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from services.stack.embedded import pid_alive

REPO = Path(__file__).resolve().parents[2]


NO_HOLDOUT_MEASURE = {"RTRL_DEMO__HOLDOUT_MEASURE_S": "0"}
"""The demo serves ``holdout_measure_s`` (60 s, 300 s on vLLM) more once its loop has ended, so
its report can compare the last champion with the holdout; no e2e test asserts on that
comparison (tests/integration/test_holdout_live.py and the unit tier do), so the bounded
runs skip it. The holdout itself (15% of the users) still runs."""


def demo_env(demo: Mapping[str, str]) -> dict[str, str]:
    """This process's environment without any RTRL_* setting but the demo's own (the demo
    configures its own stack), plus ``demo``'s RTRL_DEMO__* settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RTRL_") or k.startswith("RTRL_DEMO__")}
    return {**env, **demo}


def run_demo(args: list[str], data: Path, reports: Path, env: Mapping[str, str],
             timeout_s: float) -> tuple[subprocess.CompletedProcess[str], str]:
    """``rtrl demo ARGS --data-dir --report-dir --keep-stack`` in a subprocess from the
    repository; (the process, its stdout and stderr)."""
    argv = [sys.executable, "-m", "services.cli", "demo", *args, "--data-dir", str(data),
            "--report-dir", str(reports), "--keep-stack"]
    proc = subprocess.run(argv, cwd=REPO, env=dict(env), capture_output=True, text=True, timeout=timeout_s)
    return proc, proc.stdout + proc.stderr


def leftovers(data: Path) -> dict[str, int]:
    """Processes the demo recorded that are still running (none should be)."""
    pids = json.loads((data / "pids.json").read_text()) if (data / "pids.json").exists() else {}
    return {n: pid for n, pid in pids.items() if pid_alive(pid)}


STORY = (" rtrl.trainer: increment: ", " rtrl.trainer: cadence: start", "trainer.increment: increment ",
         " rtrl.deployer: canary ")


def story(data: Path, width: int = 260) -> str:
    """The loop's decisive log lines (increments started and finished, canary transitions), in
    time order: what a failure message needs first."""
    lines: list[str] = []
    for name in ("trainer.log", "deployer.log"):
        path = data / "logs" / name
        if path.exists():
            text = path.read_text(errors="replace").splitlines()
            lines += [ln[:width] for ln in text if any(mark in ln for mark in STORY)]
    return "the loop's story:\n" + "\n".join(sorted(lines))
