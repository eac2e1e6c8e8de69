"""``rtrl demo``: the whole closed loop on an embedded stack, from nothing, with a report.

1. Start a private embedded stack (broker, Redis, MLflow) on free ports in the demo's data
   directory (default ``.rtrl/demo``, wiped at the start of each run).
2. Write the demo's configuration: producer keys, a reward spec, and a bootstrap corpus of
   mediocre completions (too long, half on the users' preferences).
3. ``rtrl bootstrap --corpus`` makes the first champion (the supervised step).
4. Start every service as its own process: ingest, reward, trainer (compressed cadence),
   gateway, deployer (short bakes) and the simulated users.
5. Watch: a progress line every few seconds (phase, champion, candidate, canary weight,
   live cohort metrics per arm). Once enough canaries have been decided, inject one
   deliberately bad candidate (a reward-hacked policy that asks questions, or corrupted
   weights), registered like an increment with tag ``rtrl.kind`` naming it and the
   ``candidate`` alias; the deployer must roll it back by itself.
6. Stop every process (SIGTERM, then SIGKILL), read the rewards topic and the ledger, write
   ``<report_dir>/<run>/report.md`` with plots, and stop the stack (unless --keep-stack).

Ctrl-C (or SIGTERM) at any point still stops everything and writes what report it can.

The parts: demo_config.py (the plan, the spec, corpus and environment), demo_services.py
(the stack and the processes), demo_watch.py (following the loop), demo_inject.py (the bad
candidate); this module runs them in order (:func:`run_phases`) and always ends with
:func:`finish`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import FrameType
from typing import Any

from deployer.adapters.redis_state import candidate_lock, wake_deployer
from ingest.contracts.registry import Tag
from services.demo import engine as demo_engine
from services.demo.chaos import Chaos, ChaosResult, verify
from services.demo.config import (
    DemoConfig,
    DemoPlan,
    configure,
    prepare_data_dir,
)
from services.demo.console import say, stdout_to_stderr
from services.demo.inject import BadCandidateInjector, BadCandidates, bad_kinds
from services.demo.load import MAX_LOAD, BusyLoad
from services.demo.services import (
    LazyRegistry,
    Live,
    bootstrap,
    connect,
    new_stack,
    pin_holdout,
    start_services,
    start_stack,
    stop_services,
    stop_stack,
)
from services.demo.watch import read_decisions, watch
from services.report.sources import Decision, read_rewards
from services.report.write import write_report
from services.runtime.json_doc import strict_json
from services.settings.model import Settings
from services.stack.embedded import EmbeddedStack
from services.wiring.deployer import judge_policy_for


class DemoInterruptError(Exception):
    pass


def _raise_interrupt(signum: int, _frame: FrameType | None) -> None:
    raise DemoInterruptError(f"signal {signum}")


@dataclass
class Run:
    """What the phases have started and recorded so far; :func:`finish` stops exactly what
    was started and reports what was recorded."""

    stack: EmbeddedStack | None = None
    config: DemoConfig | None = None
    live: Live | None = None
    bad: BadCandidates | None = None
    bootstrap_version: str | None = None
    chaos: Chaos | None = None
    chaos_result: ChaosResult | None = None
    report_path: Path | None = None
    summary: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    """Said in the report's Notes section."""
    loop_started: float | None = None
    """When the services were up and the loop began (None: it never did)."""

    def document(self, code: int) -> dict[str, Any]:
        """What ``rtrl demo --json`` prints: the exit code, the report and its summary (the
        decisions, the comparisons), the chaos checks and the notes."""
        return strict_json({
            "exit_code": code,
            "report": str(self.report_path) if self.report_path else None,
            "bootstrap_version": self.bootstrap_version,
            "bad_version": self.bad.version if self.bad is not None else None,
            "bad_versions": self.bad.tries if self.bad is not None else [],
            "summary": self.summary,
            "chaos": self.chaos_result.to_dict() if self.chaos_result is not None else None,
            "notes": self.notes,
        })


def execute(plan: DemoPlan, run: Run | None = None) -> int:
    """The phases, then the end (even after Ctrl-C, SIGTERM or a failure); the exit code.
    ``run`` (a new one by default) is left holding what was started and recorded."""
    run = Run() if run is None else run
    old_term = signal.signal(signal.SIGTERM, _raise_interrupt)
    code = 0
    load = BusyLoad(plan.demo.load, max_s=plan.longest_s() + 900)
    try:
        if load.n:
            load.start()
            say(f"load: {load.describe()}, stopped with the demo")
            run.notes.append(f"Run with {load.describe()} (`--load {load.n}`).")
        code = run_phases(plan, run)
    except (KeyboardInterrupt, DemoInterruptError) as exc:
        say(f"interrupted ({exc or 'Ctrl-C'}): stopping everything")
        run.notes.append("The run was interrupted before its planned end.")
        code = 130
    except Exception as exc:
        say(f"demo failed: {type(exc).__name__}: {exc}")
        run.notes.append(f"The demo failed: {type(exc).__name__}: {exc}")
        code = 1
    finally:
        with _signals_ignored(restore_term=old_term):
            finish(plan, run)
            load.stop()
    if code == 0 and run.chaos_result is not None and not run.chaos_result.ok:
        code = 1
    if code == 0 and not served(run):
        say(f"the loop served nothing: {nothing_served(plan, run)}")
        code = 1
    return code


def nothing_served(plan: DemoPlan, run: Run) -> str:
    """Why a run that ended normally has no reward record, in one line."""
    budget = plan.budget()
    if run.loop_started is None:
        return f"the loop never started within {budget}; give it more --minutes, or leave --minutes out"
    setup = (run.loop_started - plan.started) / 60
    return (f"no reward record was closed (setup took {setup:.1f} min; the loop had {budget}); see the "
            f"services' logs in {plan.data / 'logs'}")


def served(run: Run) -> bool:
    """Whether the loop produced evidence: at least one reward record in the report."""
    return bool(run.summary and run.summary.get("records"))


@contextmanager
def _signals_ignored(restore_term: Callable[[int, FrameType | None], Any] | int | None,
                     ) -> Iterator[None]:
    """Ignore Ctrl-C and SIGTERM (the end must not be cut short); then restore them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, restore_term)


def run_phases(plan: DemoPlan, run: Run) -> int:
    """Stack, configuration, bootstrap, services, then watch the loop; 1 if the bootstrap
    made no champion."""
    prepare_data_dir(plan.data)
    run.stack = stack = new_stack(plan.data)  # recorded before it starts: the end stops a half-up stack
    start_stack(stack)
    run.config = config = configure(plan, stack.env())
    run.live = live = connect(plan, config)
    say(f"configuration written: reward spec {config.spec_path.name} (time scale {plan.demo.time_scale:g}: "
        f"1 h of user time = {3600 * plan.demo.time_scale:.0f} s), corpus {config.corpus.name}, "
        f"logs in {plan.data / 'logs'}")
    corpus = config.corpus
    bootstrap_args: tuple[str, ...] = ("--epochs", "2")
    if config.engine_port is not None:
        corpus = demo_engine.prepare(plan.data, plan.demo.seed, live.supervisor, config.engine_port,
                                     plan.demo.model_cache_dir, agent=plan.demo.agent)
        bootstrap_args = tuple(demo_engine.bootstrap_args(plan.data))
        run.notes.append("Served by vLLM's CPU build: a tiny Llama-architecture model built by the demo, "
                         "chat users, LoRA increments loaded into the engine before their canaries.")
    run.bootstrap_version = bootstrap(live, corpus, run.notes, bootstrap_args)
    if run.bootstrap_version is None:
        return 1
    if config.engine_port is not None:
        demo_engine.await_engine(live.supervisor, config.engine_port)
    if plan.demo.holdout_share > 0:
        pin_holdout(live, config, run.bootstrap_version, plan.demo.holdout_share)
    start_services(live.supervisor, config.gateway_port, run.notes)
    run.loop_started = time.time()
    prefix = config.settings.redis.key_prefix
    run.bad = BadCandidates([
        BadCandidateInjector(plan.demo, plan.data / f"bad-candidate-{kind}", live.world, live.registry,
                             candidate_lock(live.redis, prefix),
                             wake=lambda reason: wake_deployer(live.redis, prefix, reason), kind=kind)
        for kind in bad_kinds(plan.demo)])
    if plan.demo.chaos:
        run.chaos = Chaos(live.supervisor, plan.demo.chaos_every_s, plan.demo.seed)
        say(f"chaos: a random service is killed (SIGKILL) and restarted every {plan.demo.chaos_every_s:g}s")
    watch(plan, live, run.bad, run.notes, run.chaos)
    return 0


def finish(plan: DemoPlan, run: Run) -> None:
    """Stop the services, write the report, stop the stack (each only if it was started)."""
    if run.live is not None:
        stop_services(run.live.supervisor)
        run.live.tracker.stop()
    if run.chaos is not None and run.config is not None:
        check_chaos(run, run.config)
    if run.stack is not None and run.config is not None:
        try:
            report(plan, run, run.config, run.stack.mlflow_uri)
        except Exception as exc:
            say(f"could not write the report: {type(exc).__name__}: {exc}")
    if run.live is not None:
        run.live.redis.close()
    if run.stack is not None:
        stop_stack(run.stack, plan.keep_stack)


def check_chaos(run: Run, config: DemoConfig) -> None:
    """Reconcile the topics and check the ledger after a chaos run; say and note the result."""
    assert run.chaos is not None
    say("chaos: reconciling the topics and checking the ledger ...")
    mlf = config.settings.mlflow
    try:
        result = verify(run.chaos, config.env, mlf.tracking_uri, mlf.deployments_experiment)
    except Exception as exc:
        result = ChaosResult(kills=list(run.chaos.kills), reconcile_error=f"{type(exc).__name__}: {exc}")
    run.chaos_result = result
    say(result.line())
    run.notes.append(result.line())
    (config.spec_path.parent / "chaos.json").write_text(json.dumps(result.to_dict(), indent=2, default=str))


def report(plan: DemoPlan, run: Run, config: DemoConfig, mlflow_url: str) -> None:
    """Write the report from the rewards topic (else what the tracker kept) and the ledger;
    say its headline figures."""
    settings = config.settings
    records = read_rewards(settings)
    if not records and run.live is not None:
        records = run.live.tracker.snapshot()
    decisions = read_decisions(settings)
    registry = run.live.registry if run.live is not None else LazyRegistry(settings)
    kinds = version_kinds(run, decisions, registry)
    promoted = [d.candidate for d in decisions if d.outcome == "promoted"]
    path = write_report(
        plan.report_dir, records, [replace(d, kind=kinds.get(d.candidate, d.kind)) for d in decisions],
        primary_horizon_s=config.primary_horizon, baseline_version=run.bootstrap_version,
        final_version=promoted[-1] if promoted else None,
        bad_version=run.bad.version if run.bad is not None else None,
        bad_versions=run.bad.tries if run.bad is not None else (), started=plan.started,
        finished=time.time(), command=plan.command, mlflow_url=mlflow_url, kinds=kinds, notes=run.notes,
        judge_policy=judge_policy_for(settings),
    )
    say(f"report: {path} ({len(records)} reward records, {len(decisions)} decisions)")
    run.report_path = path
    run.summary = json.loads((path.parent / "summary.json").read_text())
    say_headline(run.summary)


def version_kinds(run: Run, decisions: list[Decision], registry: LazyRegistry) -> dict[str, str]:
    """Version -> what it was: the bootstrap, the injected bad candidates, then each decided
    version's ``rtrl.kind`` tag in the registry."""
    kinds = {run.bootstrap_version: "bootstrap"} if run.bootstrap_version else {}
    kinds.update(run.bad.kinds() if run.bad is not None else {})
    reg = registry()
    for d in decisions:
        try:
            kinds.setdefault(d.candidate, reg.get_tags(d.candidate).get(Tag.KIND, ""))
        except Exception:  # noqa: S112 (a version's kind is decoration in the report)
            continue
    return kinds


def say_headline(summary: dict[str, Any]) -> None:
    comp, chain = summary.get("comparison"), summary.get("chain")
    held = (summary.get("holdout") or {}).get("headline")
    if comp:
        say(f"bootstrap v{comp['baseline']} -> champion v{comp['final']}, whole run: {_figures(comp)}")
    if chain:
        say(f"side by side over {' -> '.join('v' + v for v in chain['versions'])}: {_figures(chain)}")
    if held:
        say(f"champion v{held['champion']} against the holdout v{held['pinned']}, same minutes: "
            f"{_figures(held['comparison'])}")


def _figures(c: dict[str, Any]) -> str:
    return (f"edit persistence {_pct(c['persistence_change'])}, mean latency {_pct(c['latency_change'])}, "
            f"dissatisfied follow-ups {_pct(c.get('dissatisfied_change'))}")


def _pct(x: Any) -> str:
    try:
        value = float(x)
    except (TypeError, ValueError):
        return "n/a"
    return "n/a" if math.isnan(value) else f"{value:+.1%}"


def main(argv: list[str]) -> int:
    base = Settings().demo
    parser = argparse.ArgumentParser(prog="rtrl demo", description=__doc__.split("\n")[0])
    parser.add_argument("--loop-minutes", type=float, default=base.loop_minutes,
                        help="the loop's own budget, counted once the stack and the first champion are up "
                             "(default: 12, with --engine vllm 20)")
    parser.add_argument("--minutes", type=float, default=base.minutes,
                        help="a budget for the whole demo instead, from the stack's start to its stop: the "
                             "loop gets what the setup leaves (default: none)")
    parser.add_argument("--increments", type=int, default=base.increments,
                        help="finish once this many increments were decided (default %(default)s)")
    parser.add_argument("--until-promoted", action="store_true",
                        help="count only promoted increments towards --increments")
    parser.add_argument("--data-dir", type=Path, default=base.data_dir,
                        help="the demo's stack, registry and logs; wiped first (default %(default)s)")
    parser.add_argument("--report-dir", type=Path, default=base.report_dir,
                        help="reports go to <report-dir>/<run>/ (default %(default)s)")
    parser.add_argument("--keep-stack", action="store_true",
                        help="leave the stack (and MLflow UI) running after the demo")
    parser.add_argument("--bad-candidate",
                        choices=["reward-hacked", "corrupted", "stalling", "malformed-tool", "none"],
                        default=base.bad_candidate,
                        help="the bad candidate to inject (default %(default)s; under --agent the default "
                             "injects malformed-tool, then stalling)")
    parser.add_argument("--agent", action="store_true", default=base.agent,
                        help="agent sessions: users with multi-step tasks that need tools, rewarded per "
                             "session, judged per session (with --engine vllm: over chat, in words)")
    parser.add_argument("--engine", choices=["builtin", "vllm"], default=base.engine,
                        help="builtin: the built-in token-id policy (fast); vllm: a tiny Llama served by "
                             "vLLM's CPU build, chat users, LoRA increments (default %(default)s)")
    parser.add_argument("--seed", type=int, default=base.seed)
    parser.add_argument("--chaos", action="store_true", default=base.chaos,
                        help="kill a random service (SIGKILL) every --chaos-every seconds and restart it; "
                             "reconcile the topics and check the ledger at the end")
    parser.add_argument("--chaos-every", type=float, default=base.chaos_every_s, metavar="SECONDS",
                        help="seconds between chaos kills (default %(default)s)")
    parser.add_argument("--load", type=int, default=base.load, metavar="N",
                        help="run N busy processes (one core each) beside the demo and stop them with it: "
                             "a busy machine to try the loop on (default %(default)s)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON document on stdout at the end (exit code, report, summary, "
                             "chaos checks); progress and every service's output go to stderr")
    args = parser.parse_args(argv)
    demo = base.model_copy(update={
        "minutes": args.minutes, "loop_minutes": args.loop_minutes, "increments": args.increments,
        "data_dir": args.data_dir,
        "until_promoted": args.until_promoted or base.until_promoted,
        "report_dir": args.report_dir, "bad_candidate": args.bad_candidate, "seed": args.seed,
        "chaos": args.chaos, "chaos_every_s": args.chaos_every, "engine": args.engine, "load": args.load,
        "agent": args.agent,
    })
    named = any(a.startswith("--bad-candidate") for a in argv)
    if args.agent and args.bad_candidate == "reward-hacked" and named:
        parser.error("--agent: the reward-hacked candidate asks one-shot users; use stalling, "
                     "malformed-tool, corrupted or none (the default injects malformed-tool, then stalling)")
    if not args.agent and args.bad_candidate in {"stalling", "malformed-tool"}:
        parser.error(f"--bad-candidate {args.bad_candidate} is an agent's: add --agent")
    if not 0 <= args.load <= MAX_LOAD:
        parser.error(f"--load takes 0 to {MAX_LOAD} busy processes")
    given = [m for m in (args.loop_minutes, args.minutes) if m is not None]
    if not all(m > 0 for m in given):
        parser.error("--loop-minutes and --minutes take a positive number of minutes")
    command = "rtrl demo " + " ".join(argv) if argv else "rtrl demo"
    plan = DemoPlan.create(demo, args.keep_stack, command.strip(), os.environ)
    if not args.json:
        return execute(plan)
    run = Run()
    with stdout_to_stderr():
        code = execute(plan, run)
    print(json.dumps(run.document(code), indent=2, sort_keys=True, default=str))
    return code
