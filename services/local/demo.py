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
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import shutil
import signal
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Any

from services.local.supervisor import ProcSpec, RewardsTracker, Supervisor, module_available, serve_argv
from services.runtime.settings import DemoSettings, Settings

MARKER = ".rtrl-demo"
"""A data directory holding this file was made by the demo and may be wiped by it."""

SERVICES: tuple[tuple[str, str], ...] = (
    ("ingest", "services.serve_ingest"),
    ("reward", "services.serve_reward"),
    ("gateway", "services.serve_gateway"),
    ("trainer", "services.serve_trainer"),
    ("deployer", "services.serve_deployer"),
    ("simulator", "services.local.simulator"),
)
"""(service, module) in start order; stopped in reverse (users first, stack last)."""
MAX_BAD_TRIES = 3
DEMO_LR = 2e-3
"""The trainer's learning rate in the demo: one increment of about 3,000 records then moves
the policy by 1.35-2.64 nats of KL (offline, docs/benchmarks.md), enough to show in a canary."""
STOP_RESERVE_S = 75.0
"""Time kept at the end of the budget for stopping the services, writing the report and
stopping the stack (about 40-50 s measured on 2 cores), so the whole demo ends within it."""
BASELINE_REWARDS = 150
"""Reward records to collect before the bad candidate goes in (the stable cohort's baseline)."""
STOP_ORDER: tuple[str | tuple[str, ...], ...] = (
    "simulator", ("gateway", "deployer", "trainer"), "reward", "ingest")
"""Users first; then the gateway (flushing its served events), the deployer and the trainer
together (the trainer's Ray shutdown takes the longest and holds up no one); then the
reward worker and ingest, which drain what the others wrote."""


def say(msg: str) -> None:
    stamp = datetime.now(UTC).strftime("%H:%M:%S")
    print(f"[{stamp}] {msg}", flush=True)


# --------------------------------------------------------------------------- configuration


def demo_spec_text(base: str, no_edit_penalty: float = 0.5) -> str:
    """The packaged reward spec with the demo's version, windows, latency SLO and no-edit
    penalty.

    Horizons keep their meaning (30 s, 10 min, 1 h of user time); ``time_scale`` compresses
    them. Grace and follow-up windows are widened so that, compressed, they still leave
    the broker a few seconds; the SLO matches the simulated per-token cost. A clarifying
    question or an empty completion costs ``no_edit_penalty`` (the product penalty Cursor's
    fix amounts to): without it, proposing no edit pays on the simulator's ambiguous tasks and
    the increments drift that way. The version names the penalty, so records say which
    definition made them.
    """
    import tomllib

    spec = tomllib.loads(base)
    spec["version"] = f"demo-v2-n{no_edit_penalty:g}"
    spec["window"]["grace_s"] = 600.0
    spec["window"]["followup_s"] = 600.0
    spec["latency"]["slo_ms"] = 400.0
    spec["latency"]["weight"] = 0.5
    spec["no_edit"] = {"question": float(no_edit_penalty), "empty": float(no_edit_penalty)}
    return _toml(spec)


def _toml(data: dict[str, Any]) -> str:
    def val(v: Any) -> str:
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, list | tuple):
            return "[" + ", ".join(val(x) for x in v) + "]"
        return repr(v)

    lines = ["# rtrl demo reward spec (written by rtrl demo)"]
    lines += [f"{k} = {val(v)}" for k, v in data.items() if not isinstance(v, dict)]
    for k, v in data.items():
        if isinstance(v, dict):
            lines += ["", f"[{k}]"] + [f"{kk} = {val(vv)}" for kk, vv in v.items()]
    return "\n".join(lines) + "\n"


def write_corpus(path: Path, seed: int, n: int = 2500) -> Path:
    """A bootstrap corpus of mediocre completions in ``rtrl bootstrap``'s format: JSON lines
    ``{"prompt": [ids], "completion": [ids]}`` (ids of trainer/tokens.py), the pairs of
    :func:`services.local.sim_users.bootstrap_corpus`."""
    from services.local.sim_users import bootstrap_corpus

    with open(path, "w") as out:
        for prompt, completion in bootstrap_corpus(n, seed):
            out.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")
    return path


def service_env(demo: DemoSettings, data: Path, stack_env: dict[str, str], gateway_port: int,
                keys: dict[str, str], spec_path: Path) -> dict[str, str]:
    """Every RTRL_* setting the demo's processes share."""
    ts = demo.time_scale
    env = {
        **stack_env,
        "RTRL_STACK__DATA_DIR": str(data / "stack"),
        "RTRL_AUTH__KEYS": json.dumps(keys),
        "RTRL_REWARD_SPEC": str(spec_path),
        "RTRL_REWARD__TIME_SCALE": f"{ts:g}",
        "RTRL_REWARD__POLL_TIMEOUT_MS": "200",
        "RTRL_TRAINER__INTERVAL_S": f"{demo.trainer_cadence_s:g}",
        "RTRL_TRAINER__DATA_DIR": str(data / "trainer"),
        "RTRL_TRAINER__MISFIRE_GRACE_S": "30",
        "RTRL_TRAINER__MIN_RECORDS": "200",
        "RTRL_TRAINER__STOP_GRACE_S": "10",  # within the demo's 20 s stop grace: an increment
        # running at the end is left to resume from its checkpoint, and the trainer exits 0
        "RTRL_TRAINER__LR": f"{DEMO_LR:g}",
        "RTRL_TRAINER__GATE__MAX_KL": "6",
        "RTRL_GATEWAY__PORT": str(gateway_port),
        "RTRL_GATEWAY__SIMULATED_MS_PER_TOKEN": f"{demo.simulated_ms_per_token:g}",
        "RTRL_GATEWAY__MIN_TOKENS": "1",  # no empty answers: see docs/demo.md
        "RTRL_GATEWAY__MODEL_CACHE_DIR": str(data / "gateway-cache"),
        "RTRL_GATEWAY__CHAMPION_REFRESH_S": "2",
        "RTRL_GATEWAY__LOAD_RETRY_S": "5",
        "RTRL_DEPLOYER__TICK_S": "3",
        "RTRL_DEPLOYER__STEPS": "[0.1,0.25,0.5]",
        "RTRL_DEPLOYER__BAKE_S": "15",
        "RTRL_DEPLOYER__MAX_DURATION_S": "210",
        "RTRL_DEPLOYER__JUDGE_ALPHA": "0.05",
        "RTRL_DEPLOYER__LEASE_TTL_S": "10",
        "RTRL_DEPLOYER__JUDGE_MIN_USERS": "60",
        "RTRL_DEPLOYER__JUDGE_MIN_REQUESTS": "60",
        "RTRL_SIMULATOR__GATEWAY_URL": f"http://127.0.0.1:{gateway_port}",
        "RTRL_SIMULATOR__TIME_SCALE": f"{ts:g}",
        "RTRL_SIMULATOR__RATE_PER_S": f"{demo.sim_rate_per_s:g}",
        "RTRL_SIMULATOR__N_USERS": str(demo.sim_users),
        "RTRL_SIMULATOR__CONCURRENCY": "8",
        "RTRL_SIMULATOR__MAX_TOKENS": "16",
        "RTRL_SIMULATOR__SEED": str(demo.seed),
        "RTRL_HTTP__PORT": "0",
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        "PYTHONUNBUFFERED": "1",
    }
    return {**env, **judge_tolerance_env()}


DEMO_JUDGE_MDE = {"persistence": 0.1, "acceptance": 0.1, "reward": 0.2, "dissatisfied": 0.08}
"""The judge's tolerances for the demo's small canaries (hundreds of requests per arm, not
thousands): a canary must be shown no worse than these before it is promoted."""


def judge_tolerance_env() -> dict[str, str]:
    """``RTRL_DEPLOYER__JUDGE_MDE`` when the deployer has that setting (else nothing: an
    unknown nested setting would be rejected)."""
    from services.runtime.settings import DeployerSettings

    if "judge_mde" in DeployerSettings.model_fields:
        return {"RTRL_DEPLOYER__JUDGE_MDE": json.dumps(DEMO_JUDGE_MDE)}
    return {}


def prepare_data_dir(data: Path) -> None:
    """Wipe a previous demo's directory (stopping its stack); refuse a foreign directory."""
    if data.exists() and any(data.iterdir()):
        if not (data / MARKER).exists():
            raise SystemExit(f"rtrl demo: {data} exists and was not made by rtrl demo; "
                             "pass --data-dir pointing at a new or previous demo directory")
        from services.local.stack import EmbeddedStack
        from services.local.supervisor import stop_recorded

        leftovers = stop_recorded(data / "pids.json")
        if leftovers:
            say(f"stopped leftovers of a previous demo run: {', '.join(leftovers)}")
        EmbeddedStack(data_dir=data / "stack").down()
        shutil.rmtree(data)
    data.mkdir(parents=True, exist_ok=True)
    (data / MARKER).write_text("made by rtrl demo; wiped by the next run\n")


# --------------------------------------------------------------------------- the run


class DemoInterruptError(Exception):
    pass


def _raise_interrupt(signum: int, _frame: FrameType | None) -> None:
    raise DemoInterruptError(f"signal {signum}")


class DemoRun:
    def __init__(self, demo: DemoSettings, keep_stack: bool, command: str) -> None:
        self.demo = demo
        self.keep_stack = keep_stack
        self.command = command
        self.data = demo.data_dir.resolve()
        self.run_name = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
        self.report_dir = demo.report_dir / self.run_name
        self.t0 = time.time()
        self.stack: Any = None
        self.supervisor: Supervisor | None = None
        self.tracker: RewardsTracker | None = None
        self.settings: Settings | None = None
        self.registry: Any = None
        self.redis: Any = None
        self.world: Any = None
        self.unavailable: list[str] = []
        self.notes: list[str] = []
        self.bootstrap_version: str | None = None
        self.bad_version: str | None = None
        self.bad_offered = False
        """Whether ``bad_version`` holds the candidate alias (it waits while another canary runs)."""
        self.bad_tries: list[str] = []
        """Every bad candidate registered; one whose canary is aborted before a verdict (say by an
        operator) is replaced by a new version (up to MAX_BAD_TRIES)."""
        self.kinds: dict[str, str] = {}
        self.decided: dict[str, str] = {}
        self.primary_horizon = 600
        self.champion: str | None = None

    # ------------------------------------------------------------ phases
    def execute(self) -> int:
        old_term = signal.signal(signal.SIGTERM, _raise_interrupt)
        code = 0
        try:
            self.start_stack()
            self.configure()
            if not self.bootstrap():
                code = 1
            else:
                self.start_services()
                self.loop()
        except (KeyboardInterrupt, DemoInterruptError) as exc:
            say(f"interrupted ({exc or 'Ctrl-C'}): stopping everything")
            self.notes.append("The run was interrupted before its planned end.")
            code = 130
        except Exception as exc:
            say(f"demo failed: {type(exc).__name__}: {exc}")
            self.notes.append(f"The demo failed: {type(exc).__name__}: {exc}")
            code = 1
        finally:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            try:
                self.shutdown()
            finally:
                signal.signal(signal.SIGINT, signal.default_int_handler)
                signal.signal(signal.SIGTERM, old_term)
        return code

    def start_stack(self) -> None:
        from services.local.stack import EmbeddedStack, free_port

        prepare_data_dir(self.data)
        say(f"starting the embedded stack in {self.data / 'stack'} (broker, Redis, MLflow) ...")
        self.stack = EmbeddedStack(
            data_dir=self.data / "stack", kafka_port=free_port(), redis_port=free_port(),
            mlflow_port=free_port(), reuse_redis_url=None, with_mlflow=True,
        )
        t = time.monotonic()
        self.stack.up(timeout_s=120)
        say(f"stack ready in {time.monotonic() - t:.0f}s: kafka {self.stack.kafka_bootstrap}, "
            f"redis {self.stack.redis_url}, mlflow {self.stack.mlflow_uri}")

    def configure(self) -> None:
        from ingest.reward.spec import default_spec_text, load_spec
        from services.local.sim_users import make_world
        from services.local.stack import free_port
        from services.runtime.kafka_io import ensure_topics
        from services.runtime.redis_io import make_redis

        keys = {"gateway": secrets.token_hex(16), "simulator": secrets.token_hex(16)}
        spec_path = self.data / "reward-spec.toml"
        spec_path.write_text(demo_spec_text(default_spec_text(), self.demo.no_edit_penalty))
        self.primary_horizon = load_spec(spec_path).persistence.primary_horizon_s
        self.corpus = write_corpus(self.data / "bootstrap-corpus.jsonl", self.demo.seed)
        self.gateway_port = free_port()
        env = service_env(self.demo, self.data, self.stack.env(), self.gateway_port, keys, spec_path)
        self.env = env
        saved = dict(os.environ)
        try:
            os.environ.update(env)
            self.settings = Settings()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        ensure_topics(self.settings)
        self.supervisor = Supervisor(self.data / "logs", env, pid_file=self.data / "pids.json")
        self.redis = make_redis(self.settings.redis)
        self.world = make_world(self.demo.seed)
        self.tracker = RewardsTracker(self.settings, self.primary_horizon).start()
        say(f"configuration written: reward spec {spec_path.name} (time scale {self.demo.time_scale:g}: "
            f"1 h of user time = {3600 * self.demo.time_scale:.0f} s), corpus {self.corpus.name}, "
            f"logs in {self.data / 'logs'}")

    def _registry(self) -> Any:
        if self.registry is None:
            from deployer.adapters.mlflow_registry import MlflowRegistry

            s = self.settings
            assert s is not None
            self.registry = MlflowRegistry(s.mlflow.tracking_uri, s.mlflow.registered_model,
                                           s.mlflow.training_experiment)
        return self.registry

    def bootstrap(self) -> bool:
        assert self.supervisor is not None
        if not module_available("services.trainer_job"):
            self.unavailable.append("bootstrap (services/trainer_job.py is not installed)")
            say("UNAVAILABLE: rtrl bootstrap (services/trainer_job.py missing): no first champion, "
                "the loop cannot run")
            return False
        say("bootstrapping the first champion (supervised run on the corpus) ...")
        t = time.monotonic()
        spec = ProcSpec("bootstrap", [sys.executable, "-m", "services.cli", "bootstrap",
                                      "--corpus", str(self.corpus), "--epochs", "2"])
        rc = self.supervisor.run(spec, timeout_s=900)
        if rc != 0:
            say(f"bootstrap failed (exit {rc}):\n{self.supervisor.log_tail('bootstrap')}")
            self.notes.append(f"rtrl bootstrap failed with exit code {rc}.")
            return False
        self.bootstrap_version = self._registry().alias_version("champion")
        if self.bootstrap_version:
            self.kinds[self.bootstrap_version] = "bootstrap"
        say(f"bootstrap champion v{self.bootstrap_version} registered in {time.monotonic() - t:.0f}s")
        return self.bootstrap_version is not None

    def start_services(self) -> None:
        assert self.supervisor is not None
        for name, module in SERVICES:
            if not module_available(module):
                self.unavailable.append(f"{name} ({module.replace('.', '/')}.py is not installed)")
                say(f"UNAVAILABLE: rtrl serve {name} ({module} missing); the loop runs without it")
                continue
            if name == "simulator" and "gateway" in self.supervisor.procs:
                self.wait_gateway()
            self.supervisor.start(ProcSpec(name, serve_argv(name)))
        running = [n for n in self.supervisor.procs]
        say(f"services started: {', '.join(running)}; gateway on http://127.0.0.1:{self.gateway_port}")
        if self.unavailable:
            self.notes.append("Unavailable in this run: " + "; ".join(self.unavailable))

    def wait_gateway(self, timeout_s: float = 90.0) -> None:
        """Until the gateway answers /readyz (it has loaded the champion), or the timeout."""
        import urllib.request

        url = f"http://127.0.0.1:{self.gateway_port}/readyz"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        say(f"the gateway is not ready after {timeout_s:.0f}s; starting the users anyway "
            f"(see {self.data / 'logs' / 'gateway.log'})")

    # ------------------------------------------------------------ watching
    def routing(self) -> dict[str, str]:
        assert self.settings is not None
        prefix = self.settings.redis.key_prefix
        names = ("canary_weight", "stable_version", "canary_version")
        try:
            vals = self.redis.mget([f"{prefix}routing:{n}" for n in names])
        except Exception:
            return {}
        return {n: (v.decode() if isinstance(v, bytes) else str(v)) for n, v in zip(names, vals, strict=True)
                if v is not None}

    def deployer_status(self) -> dict[str, Any]:
        """The deployer's persisted status, if it can be found in Redis."""
        assert self.settings is not None
        prefix = self.settings.redis.key_prefix
        for key in (f"{prefix}deployer:status", f"{prefix}canary:status", f"{prefix}deployer:state"):
            try:
                raw = self.redis.get(key)
            except Exception:
                return {}
            if raw:
                try:
                    data = json.loads(raw)
                    return data if isinstance(data, dict) else {}
                except ValueError:
                    return {}
        return {}

    def decisions(self) -> list[Any]:
        from services.local.report import read_ledger

        assert self.settings is not None
        try:
            return read_ledger(self.settings.mlflow.tracking_uri, self.settings.mlflow.deployments_experiment)
        except Exception:
            return []

    def progress_line(self, status: dict[str, Any], routing: dict[str, str]) -> str:
        assert self.tracker is not None
        elapsed = time.time() - self.t0
        phase = status.get("phase", "?")
        champion = self.champion or routing.get("stable_version") or "?"
        cand = status.get("candidate") or routing.get("canary_version")
        weight = float(routing.get("canary_weight") or status.get("weight") or 0.0)
        head = f"{int(elapsed // 60)}:{int(elapsed % 60):02d} phase={phase} champion=v{champion}"
        if cand:
            head += f" candidate=v{cand} @{weight:.0%}"
        parts = [head]
        for (version, arm), c in sorted(self.tracker.recent(60.0).items()):
            if c.n < 5:
                continue
            parts.append(f"{arm} v{version}: n={c.n} persist={_f(c.edit_persistence)} "
                         f"lat={_f(c.latency_ms, '.0f')}ms reward={_f(c.reward)} "
                         f"edits={_f(c.edit_rate, '.0%')}")
        if self.decided:
            parts.append("decided: " + ", ".join(f"v{v} {o}" for v, o in self.decided.items()))
        parts.append(f"rewards={self.tracker.count()}")
        return " | ".join(parts)

    def maybe_inject_bad(self, status: dict[str, Any]) -> None:
        """Register the deliberately bad candidate once the loop is ready for it, then offer it
        as ``candidate`` through the same locked check-and-set as the trainer
        (:func:`deployer.registry.offer_candidate`): it waits while another canary is pending or
        in flight, and an increment finishing meanwhile leaves it in place."""
        demo = self.demo
        if demo.bad_candidate == "none":
            return
        if self.bad_version is not None:
            if self.decided.get(self.bad_version) != "aborted":
                if self.bad_offered:
                    return
            elif len(self.bad_tries) >= MAX_BAD_TRIES:
                return
            else:
                say(f"bad candidate v{self.bad_version} was aborted before a verdict (see its reason); "
                    "injecting another one")
                self.bad_version, self.bad_offered = None, False
        if len(self.decided) < demo.bad_candidate_after_decisions:
            return
        if status and status.get("phase") not in {"idle", "succeeded", "rolled_back", "aborted", None}:
            return
        if self.tracker is not None and self.tracker.count() < BASELINE_REWARDS:
            return  # let the champion build a baseline first

        from deployer.adapters.redis_state import candidate_lock
        from deployer.registry import LockUnavailableError, offer_candidate

        reg = self._registry()
        if self.bad_version is None:
            self.bad_version = self.register_bad(reg)
            if self.bad_version is None:
                return
        assert self.settings is not None
        lock = candidate_lock(self.redis, self.settings.redis.key_prefix)
        try:
            held = offer_candidate(reg, self.bad_version, lock)
        except LockUnavailableError as exc:
            say(f"could not offer bad candidate v{self.bad_version} yet: {exc}")
            return
        if held is not None:
            say(f"bad candidate v{self.bad_version} waits: v{held} holds the candidate alias")
            return
        self.bad_offered = True
        say(f"bad candidate v{self.bad_version} ({demo.bad_candidate}) now holds the candidate alias")

    def register_bad(self, reg: Any) -> str | None:
        """Build the bad policy from the current champion and register it (no alias yet)."""
        from deployer.registry import Tag
        from services.local.demo_candidates import make_bad_candidate

        demo = self.demo
        champion = reg.alias_version("champion")
        if champion is None:
            return None
        say(f"building the deliberately bad candidate ({demo.bad_candidate}) from champion v{champion} ...")
        work = self.data / "bad-candidate"
        shutil.rmtree(work, ignore_errors=True)
        src = reg.download(champion, work / "champion")
        out = make_bad_candidate(demo.bad_candidate, Path(src), work / "policy", self.world, demo.seed)
        version = str(reg.register(None, out, {
            Tag.KIND: demo.bad_candidate,
            Tag.PARENT_VERSION: champion,
            Tag.GATE_RESULT: "pass",
            Tag.GATE_REASONS: json.dumps(["injected by rtrl demo: skips the offline gate so the live "
                                          "canary must catch it"]),
        }))
        self.bad_tries.append(version)
        self.kinds[version] = demo.bad_candidate
        say(f"bad candidate v{version} registered")
        return version

    def loop(self) -> None:
        assert self.supervisor is not None and self.tracker is not None
        if "simulator" not in self.supervisor.procs or "gateway" not in self.supervisor.procs:
            say("the loop needs the gateway and the simulator; stopping")
            return
        deadline = self.t0 + self.demo.minutes * 60.0 - STOP_RESERVE_S
        last_ledger = 0.0
        what = "promoted" if self.demo.until_promoted else "decided"
        say(f"loop running for at most {max(0.0, deadline - time.time()) / 60:.1f} min (the rest of the "
            f"{self.demo.minutes:g}-minute budget less {STOP_RESERVE_S:g} s to stop) or "
            f"{self.demo.increments} {what} increments (plus the bad candidate)")
        if time.time() >= deadline:
            say(f"the stack start and the bootstrap used the whole {self.demo.minutes:g}-minute budget; "
                "no time is left for the loop (raise --minutes)")
            self.notes.append("The loop did not run: the stack start and the bootstrap used the whole "
                              "time budget.")
        status: dict[str, Any] = {}
        while time.time() < deadline:
            time.sleep(self.demo.progress_every_s)
            for name, rc in self.supervisor.newly_exited().items():
                say(f"service {name} exited with code {rc}; last lines of its log:\n"
                    f"{self.supervisor.log_tail(name)}")
                self.notes.append(f"Service {name} exited during the run with code {rc}.")
            status, routing = self.deployer_status(), self.routing()
            try:
                self.champion = self._registry().alias_version("champion")
            except Exception:
                self.champion = None
            if time.time() - last_ledger > 10:
                for d in self.decisions():
                    if d.candidate not in self.decided:
                        self.decided[d.candidate] = d.outcome
                        say(f"DECISION: v{d.candidate} {d.outcome} by {d.decided_by}: {d.reason}")
                last_ledger = time.time()
            say(self.progress_line(status, routing))
            self.maybe_inject_bad(status)
            increments = [v for v, outcome in self.decided.items() if v not in self.bad_tries
                          and (outcome == "promoted" or not self.demo.until_promoted)]
            bad_done = self.demo.bad_candidate == "none" or (
                self.bad_version is not None and self.decided.get(self.bad_version) not in {None, "aborted"}
            ) or (len(self.bad_tries) >= MAX_BAD_TRIES and self.bad_tries[-1] in self.decided)
            if len(increments) >= self.demo.increments and bad_done:
                say("enough canaries decided; finishing")
                return
        say("time budget reached; finishing")

    # ------------------------------------------------------------ the end
    def shutdown(self) -> None:
        if self.supervisor is not None:
            say("stopping services (SIGTERM, then SIGKILL after a grace period) ...")
            codes = self.supervisor.stop_all(grace_s=20, order=STOP_ORDER)
            done = ", ".join(f"{n} (exit {rc})" for n, rc in codes.items() if rc is not None)
            say(f"stopped: {done or 'nothing was running'}")
        if self.tracker is not None:
            self.tracker.stop()
        if self.stack is not None and self.settings is not None:
            try:
                self.write_report()
            except Exception as exc:
                say(f"could not write the report: {type(exc).__name__}: {exc}")
        if self.redis is not None:
            self.redis.close()
        if self.stack is not None:
            if self.keep_stack:
                say(f"stack kept running (--keep-stack): MLflow {self.stack.mlflow_uri}; stop it with "
                    f"RTRL_STACK__DATA_DIR={self.data / 'stack'} rtrl down")
            else:
                stopped = self.stack.down()
                say(f"stack stopped: {', '.join(stopped) or 'nothing was running'}")

    def write_report(self) -> None:
        from services.local.report import read_rewards, write_report

        assert self.settings is not None
        records = read_rewards(self.settings)
        if not records and self.tracker is not None:
            records = self.tracker.snapshot()
        decisions = self.decisions()
        reg = self._registry()
        for d in decisions:
            try:
                self.kinds.setdefault(d.candidate, reg.get_tags(d.candidate).get("rtrl.kind", ""))
            except Exception:  # noqa: S112 (a version's kind is decoration in the report)
                continue
        promoted = [d.candidate for d in decisions if d.outcome == "promoted"]
        final = promoted[-1] if promoted else None
        path = write_report(
            self.report_dir, records, [_with_kind(d, self.kinds) for d in decisions],
            primary_horizon_s=self.primary_horizon, baseline_version=self.bootstrap_version,
            final_version=final, bad_version=self.bad_version, started=self.t0, finished=time.time(),
            command=self.command, mlflow_url=self.stack.mlflow_uri, kinds=self.kinds, notes=self.notes,
        )
        say(f"report: {path} ({len(records)} reward records, {len(decisions)} decisions)")
        summary = json.loads((path.parent / "summary.json").read_text())
        comp, chain = summary.get("comparison"), summary.get("chain")
        if comp:
            say(f"bootstrap v{comp['baseline']} -> champion v{comp['final']}, whole run: edit persistence "
                f"{_pct(comp['persistence_change'])}, mean latency {_pct(comp['latency_change'])}")
        if chain:
            say(f"side by side over {' -> '.join('v' + v for v in chain['versions'])}: edit persistence "
                f"{_pct(chain['persistence_change'])}, mean latency {_pct(chain['latency_change'])}")


def _with_kind(d: Any, kinds: dict[str, str]) -> Any:
    from dataclasses import replace

    return replace(d, kind=kinds.get(d.candidate, d.kind))


def _f(x: float, fmt: str = ".2f") -> str:
    return "-" if isinstance(x, float) and math.isnan(x) else format(x, fmt)


def _pct(x: Any) -> str:
    try:
        return f"{float(x):+.1%}"
    except (TypeError, ValueError):
        return "n/a"


def main(argv: list[str]) -> int:
    base = Settings().demo
    parser = argparse.ArgumentParser(prog="rtrl demo", description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=base.minutes,
                        help="time budget of the whole demo, from the stack's start to its stop "
                             f"(default {base.minutes:g})")
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
    parser.add_argument("--bad-candidate", choices=["reward-hacked", "corrupted", "none"],
                        default=base.bad_candidate, help="the bad candidate to inject (default %(default)s)")
    parser.add_argument("--seed", type=int, default=base.seed)
    args = parser.parse_args(argv)
    demo = base.model_copy(update={
        "minutes": args.minutes, "increments": args.increments, "data_dir": args.data_dir,
        "until_promoted": args.until_promoted or base.until_promoted,
        "report_dir": args.report_dir, "bad_candidate": args.bad_candidate, "seed": args.seed,
    })
    command = "rtrl demo " + " ".join(argv) if argv else "rtrl demo"
    return DemoRun(demo, args.keep_stack, command.strip()).execute()
