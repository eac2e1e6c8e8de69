"""The e2e tier's shared runs.

``loop_run``: ONE ``rtrl demo --chaos --until-promoted`` run (the built-in policy) per test
session, checked by two tests of the same run: test_closed_loop.py (an automatic promotion, an
automatic rollback of the injected bad candidate, complete ledger runs in MLflow, no process
left behind) and test_chaos_loop.py (random SIGKILLs of the services, nothing lost or
duplicated, ``--json``'s document). Both used to start a demo of their own (stack, bootstrap,
services, report: 8-9 and 7-8 minutes on 2 cores); the loop now promotes under the kills.

The fixture asserts nothing: it records what the tests check (the process, its output, the
processes still running right after it, and the ledger and registry as MLflow held them before
the demo's stack was stopped), then stops everything at once, so no demo process or stack
outlives the fixture's setup even though the fixture is session-scoped.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from services.stack.embedded import EmbeddedStack
from services.stack.supervisor import stop_recorded
from tests.e2e.demo_helpers import (
    LOOP_TIMEOUT_S,
    NO_HOLDOUT_MEASURE,
    LoopRun,
    demo_env,
    leftovers,
    read_ledger,
    run_demo,
)


@pytest.fixture(scope="session")
def loop_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopRun]:
    root = tmp_path_factory.mktemp("loop")
    data, reports = root / "demo", root / "reports"
    every = float(os.environ.get("RTRL_E2E_CHAOS_EVERY_S", "60"))
    minutes = os.environ.get("RTRL_E2E_MINUTES", "22")
    env = demo_env({"RTRL_DEMO__TRAINER_CADENCE_S": os.environ.get("RTRL_E2E_CADENCE_S", "60"),
                    # the watcher's cadence: chaos is checked on it
                    "RTRL_DEMO__PROGRESS_EVERY_S": "5", **NO_HOLDOUT_MEASURE})
    args = ["--chaos", "--chaos-every", f"{every:g}", "--minutes", minutes, "--until-promoted",
            "--increments", "1", "--json"]
    stack = EmbeddedStack(data_dir=data / "stack")
    try:
        proc, out = run_demo(args, data, reports, env, timeout_s=LOOP_TIMEOUT_S - 60)
        left = leftovers(data)
        stack.load()
        ledger, ledger_error = read_ledger(stack.mlflow_uri)
    finally:
        stack.down()
        # belt and braces: nothing from this run may survive it
        stop_recorded(data / "pids.json")
    yield LoopRun(data=data, reports=reports, every=every, proc=proc, out=out, leftovers=left,
                  ledger=ledger, ledger_error=ledger_error)
