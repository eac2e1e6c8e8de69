"""What ``rtrl demo`` decides before anything runs, and what it writes for its services.

- :class:`DemoPlan`: the run's inputs, fixed once from DemoSettings and the command line
  (budget, data and report directories, the environment it was started in).
- :func:`configure`: writes the reward spec and the bootstrap corpus into the data directory,
  picks the gateway's port and returns a :class:`DemoConfig`: the one environment every
  service process gets (:func:`service_env`) and the same settings as this process reads
  them (``services.settings.model.settings_from_env``; nothing rewrites ``os.environ``).
"""

from __future__ import annotations

import hashlib
import json
import secrets
import shutil
import time
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from deployer.operators import key_line
from ingest.reward.spec import agent_spec_text, default_spec_text, load_spec
from services.demo.console import say
from services.demo.engine import engine_env
from services.settings.demo import DemoSettings
from services.settings.deployer import DeployerSettings
from services.settings.model import Settings, settings_from_env
from services.sim.agent import world_corpus
from services.stack.embedded import EmbeddedStack, free_port
from services.stack.supervisor import stop_recorded
from trainer import corpus as corpus_file

MARKER = ".rtrl-demo"
"""A data directory holding this file was made by the demo and may be wiped by it."""
DEMO_OPERATOR = "rtrl-demo"
"""The operator the demo signs its own commands as (pinning the holdout)."""
DEMO_LR = 2e-3
"""The trainer's learning rate in the demo (after :data:`DEMO_WARMUP_STEPS`): fast enough that
an increment of about 3,000 records reaches the band's target (:data:`DEMO_BAND`) within a
pass or two over its window."""
CANARY_MAX_S = 420.0
"""A canary's wall-clock cap on the built-in policy (``RTRL_DEMO__CANARY_MAX_S`` overrides
it; the vLLM demo has its own, services/demo/engine.py). The budget that normally ends an
undecided canary is in users, from its plan (docs/deployer.md): on a busy machine the users
come slower, and the canary gets the time to have them."""
DEMO_LATENCY_WEIGHT = 2.0
"""The demo spec's latency weight: at 2.0 a second-slower answer costs as much as an edit
kept, so one increment moves latency as visibly as persistence (docs/benchmarks.md)."""
DEMO_BAND = {"LOW": "0.3", "HIGH": "2", "TARGET": "1.5", "MAX_LENGTH_CHANGE": "0.2"}
"""The demo's steady step (``RTRL_TRAINER__BAND__*``): each increment aims at 1.5 nats of KL
to its parent, inside [0.3, 2], and treats a step that moves the mean completion length by
more than 20% as an overshoot (under the length detector's 25%). The high edge is well
below the demo gate's 6 nats; the low edge leaves room for the steps the guard stops early,
which still met both targets offline (docs/benchmarks.md)."""
DEMO_AGENT_BAND = {"LOW": "0.05", "HIGH": "0.4", "TARGET": "0.2"}
"""The agent demo's step: an agent's turns are two to four tokens, and its signal (one session
return shared by every turn) is faint per turn. Offline (``rtrl bench agent-offline``), steps
of 0.8 nats or more drifted from completing sessions to calls that move nothing; steps of 0.2
raised the completion rate (docs/benchmarks.md, "The agent loop without services")."""
DEMO_AGENT_INVALID_CALL = 1.0
"""The agent demo spec's penalty per invalid tool call, on the turn that made it (the packaged
agent-v1's is 0.25): a product whose users leave after two broken calls weights them more."""
DEMO_WARMUP_STEPS = 20
"""Learning-rate warm-up of the demo's increments: the first steps at the full rate were the
ones that overshot the band (docs/benchmarks.md)."""
STOP_RESERVE_S = 75.0
"""Time kept at the end of the budget for stopping the services, writing the report and
stopping the stack (about 40-50 s measured on 2 cores), so the whole demo ends within it."""
DEMO_JUDGE_MDE = {"persistence": 0.1, "acceptance": 0.1, "reward": 0.2, "dissatisfied": 0.08}
"""The judge's tolerances for the demo's small canaries (hundreds of requests per arm, not
thousands): a canary must be shown no worse than these before it is promoted."""

DEMO_SESSION_MDE = {"session_completion": 0.1, "turns_per_completed": 1.0, "session_invalid_tool_rate": 0.1}
"""The same for the per-session metrics under ``--agent`` (a canary's arm sees hundreds of
sessions): a completion rate 10 points lower, a turn more per completed session or 10 points
more sessions with a broken call is what a canary must be shown not to cost."""


@dataclass(frozen=True)
class DemoPlan:
    """The run's inputs, fixed before it starts."""

    demo: DemoSettings
    keep_stack: bool
    """Leave the stack (and the MLflow UI) running after the demo."""
    command: str
    """The command line, as the report quotes it."""
    data: Path
    """The demo's data directory (stack, registry, logs), resolved; wiped at the start."""
    report_dir: Path
    """This run's report directory, ``<demo.report_dir>/<run>``."""
    started: float
    """Wall time the run started; a whole-run budget (``demo.minutes``) counts from here."""
    environ: Mapping[str, str]
    """The environment ``rtrl demo`` was started in; the services inherit it under the demo's
    own settings (:attr:`DemoConfig.env`)."""

    @classmethod
    def create(cls, demo: DemoSettings, keep_stack: bool, command: str,
               environ: Mapping[str, str]) -> DemoPlan:
        run_name = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
        return cls(demo=demo, keep_stack=keep_stack, command=command, data=demo.data_dir.resolve(),
                   report_dir=demo.report_dir / run_name, started=time.time(), environ=dict(environ))

    def loop_deadline(self, loop_started: float) -> float:
        """When the watch loop ends: ``loop_minutes`` after it started, or, with a whole-run
        budget (``minutes``), when stopping and the report still fit in it."""
        if self.demo.minutes is None:
            return loop_started + self.demo.loop_budget_minutes() * 60.0
        return self.started + self.demo.minutes * 60.0 - STOP_RESERVE_S

    def budget(self) -> str:
        """The run's budget in words, for progress lines and errors."""
        if self.demo.minutes is None:
            return f"the loop's own {self.demo.loop_budget_minutes():g} minutes"
        return f"the {self.demo.minutes:g}-minute budget"

    def longest_s(self) -> float:
        """A bound on the whole run (for the busy load's own stop): the loop's time and the
        holdout measurement's plus 30 minutes of setup, or the whole-run budget."""
        if self.demo.minutes is not None:
            return 60.0 * self.demo.minutes
        return 60.0 * (self.demo.loop_budget_minutes() + 30) + self.demo.holdout_measure_seconds()


@dataclass(frozen=True)
class DemoConfig:
    """What :func:`configure` wrote and chose; every later part reads it."""

    spec_path: Path
    corpus: Path
    primary_horizon: int
    """The reward spec's primary persistence horizon (nominal seconds)."""
    gateway_port: int
    env: Mapping[str, str]
    """The variables every service process gets on top of the demo's environment."""
    settings: Settings
    """The settings those variables make, read by this process (topics, Redis, MLflow)."""
    engine_port: int | None = None
    """The demo's vLLM engine's port (``--engine vllm``), else None."""
    operator_token: str = ""
    """The demo's operator token (its hash is the deployer's one key): the demo pins the
    holdout with it; with ``--keep-stack``, ``rtrl holdout end --token-file <data>/operator.token``."""


def configure(plan: DemoPlan, stack_env: Mapping[str, str]) -> DemoConfig:
    """Write the reward spec and the corpus into the data directory; pick the gateway's port;
    build the services' environment and this process's settings from it."""
    demo, data = plan.demo, plan.data
    keys = {"gateway": secrets.token_hex(16), "simulator": secrets.token_hex(16)}
    spec_path = data / "reward-spec.toml"
    base = agent_spec_text() if demo.agent else default_spec_text()
    spec_path.write_text(demo_spec_text(base, demo.no_edit_penalty))
    primary_horizon = load_spec(spec_path).persistence.primary_horizon_s
    corpus = write_corpus(data / "bootstrap-corpus.jsonl", demo.seed, agent=demo.agent)
    gateway_port = free_port()
    token = secrets.token_hex(32)
    (data / "operator-keys").write_text(key_line(DEMO_OPERATOR, token) + "\n")
    token_file = data / "operator.token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    env = {**service_env(demo, data, dict(stack_env), gateway_port, keys, spec_path),
           "RTRL_OPERATORS__KEYS_FILE": str(data / "operator-keys")}
    engine_port = None
    if demo.engine == "vllm":
        engine_port = free_port()
        env.update(engine_env(data, engine_port, demo.canary_max_s, agent=demo.agent))
    return DemoConfig(spec_path=spec_path, corpus=corpus, primary_horizon=primary_horizon,
                      gateway_port=gateway_port, env=env, engine_port=engine_port,
                      settings=settings_from_env({**plan.environ, **env}), operator_token=token)


def demo_spec_text(base: str, no_edit_penalty: float | None = None,
                   latency_weight: float = DEMO_LATENCY_WEIGHT) -> str:
    """The packaged reward spec with the demo's version, windows, latency SLO and weight, and
    no-edit penalty.

    Horizons keep their meaning (30 s, 10 min, 1 h of user time); ``time_scale`` compresses
    them. Grace and follow-up windows are widened so that, compressed, they still leave
    the broker a few seconds; the SLO matches the simulated per-token cost. A clarifying
    question or an empty completion costs ``no_edit_penalty`` (the product penalty Cursor's
    fix amounts to): without it, proposing no edit pays on the simulator's ambiguous tasks and
    the increments drift that way (default: ``DemoSettings.no_edit_penalty``). The version
    names the penalty (and a latency weight other than the demo's), so records say which
    definition made them.
    """
    if no_edit_penalty is None:
        no_edit_penalty = float(DemoSettings.model_fields["no_edit_penalty"].default)
    spec = {**tomllib.loads(default_spec_text()), **tomllib.loads(base)}  # a table left out: the default's
    spec["version"] = ("demo-agent-v1" if "session" in spec else "demo-v3") + f"-n{no_edit_penalty:g}" + (
        f"-l{latency_weight:g}" if latency_weight != DEMO_LATENCY_WEIGHT else "")
    spec["window"]["grace_s"] = 600.0
    spec["window"]["followup_s"] = 600.0
    spec["latency"]["slo_ms"] = 400.0
    spec["latency"]["weight"] = float(latency_weight)
    spec["no_edit"] = {"question": float(no_edit_penalty), "empty": float(no_edit_penalty)}
    if "session" in spec:
        spec["session"] = {**spec["session"], "invalid_tool_call": DEMO_AGENT_INVALID_CALL}
    return toml_text(spec)


def toml_text(data: dict[str, Any]) -> str:
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


def write_corpus(path: Path, seed: int, n: int = 2500, agent: bool = False) -> Path:
    """A bootstrap corpus of mediocre completions in ``rtrl bootstrap``'s format: JSON lines
    ``{"prompt": [ids], "completion": [ids]}`` (ids of trainer/tokens.py), the pairs of
    :func:`services.sim.agent.world_corpus` (one-shot answers, or with ``agent`` turns of
    middling agents' sessions)."""
    corpus_file.write_corpus(path, world_corpus(n, seed, agent))
    return path


def api_key(signing_key: str) -> str:
    """The demo's API key for a client, derived from its signing key (one secret to keep)."""
    return "sk-" + hashlib.sha256(b"rtrl-api-key:" + signing_key.encode()).hexdigest()[:40]


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
        # one replica each, with a stable identity (static group membership): a restarted
        # worker takes its partitions back at once and fences its killed predecessor
        "RTRL_INGEST__INSTANCE_ID": "demo-ingest-0",
        "RTRL_REWARD__GROUP_INSTANCE_ID": "demo-reward-0",
        "RTRL_TRAINER__INTERVAL_S": f"{demo.trainer_cadence_s:g}",
        "RTRL_TRAINER__DATA_DIR": str(data / "trainer"),
        "RTRL_TRAINER__MISFIRE_GRACE_S": "30",
        "RTRL_TRAINER__CHECK_EVERY_S": "5",  # an increment that waited for a canary starts soon after it
        "RTRL_TRAINER__MIN_RECORDS": "200",
        "RTRL_TRAINER__STOP_GRACE_S": "10",  # within the demo's 20 s stop grace: an increment
        # running at the end is left to resume from its checkpoint, and the trainer exits 0
        **demo_trainer_env(demo.agent),
        "RTRL_TRAINER__GATE__MAX_KL": "6",
        "RTRL_GATEWAY__PORT": str(gateway_port),
        # the simulated users are the gateway's one API client; their API key is derived
        # from (not equal to) their event-signing key
        "RTRL_GATEWAY__API_KEYS": json.dumps({"simulator": api_key(keys["simulator"])}),
        "RTRL_SIMULATOR__API_KEY": api_key(keys["simulator"]),
        "RTRL_GATEWAY__SIMULATED_MS_PER_TOKEN": f"{demo.simulated_ms_per_token:g}",
        "RTRL_GATEWAY__MIN_TOKENS": "1",  # no empty answers: see docs/demo.md
        "RTRL_GATEWAY__MODEL_CACHE_DIR": str(data / "gateway-cache"),
        "RTRL_GATEWAY__SPOOL_DIR": str(data / "gateway-spool"),  # this run's, kept across kills
        "RTRL_GATEWAY__CHAMPION_REFRESH_S": "2",
        "RTRL_GATEWAY__LOAD_RETRY_S": "5",
        "RTRL_DEPLOYER__TICK_S": "3",
        "RTRL_DEPLOYER__STEPS": "[0.1,0.25,0.5]",
        "RTRL_DEPLOYER__BAKE_S": "15",
        "RTRL_DEPLOYER__MIN_BAKE_S": "6",  # two ticks: a step moves on a promote verdict after it
        "RTRL_DEPLOYER__MAX_DURATION_S": f"{demo.canary_max_s or CANARY_MAX_S:g}",
        "RTRL_DEPLOYER__JUDGE_ALPHA": "0.05",
        "RTRL_DEPLOYER__JUDGE_REQUIRE_IMPROVEMENT": str(demo.promotes_on_improvement()).lower(),
        "RTRL_DEPLOYER__LEASE_TTL_S": "10",
        "RTRL_DEPLOYER__JUDGE_MIN_USERS": "60",
        "RTRL_DEPLOYER__JUDGE_MIN_REQUESTS": "60",
        "RTRL_DEPLOYER__HOLDOUT_EVERY_S": "10",
        "RTRL_SIMULATOR__GATEWAY_URL": f"http://127.0.0.1:{gateway_port}",
        "RTRL_SIMULATOR__TIME_SCALE": f"{ts:g}",
        "RTRL_SIMULATOR__RATE_PER_S": f"{demo.sim_rate_per_s:g}",
        "RTRL_SIMULATOR__N_USERS": str(demo.simulated_users()),
        "RTRL_SIMULATOR__CONCURRENCY": "8",
        "RTRL_SIMULATOR__MAX_TOKENS": "16",
        "RTRL_SIMULATOR__SEED": str(demo.seed),
        "RTRL_SIMULATOR__AGENT": "true" if demo.agent else "false",
        "RTRL_HTTP__PORT": "0",
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        "PYTHONUNBUFFERED": "1",
    }
    return {**env, **judge_tolerance_env(demo.agent)}


def demo_trainer_env(agent: bool = False) -> dict[str, str]:
    """How the demo's increments learn, where it differs from the trainer's defaults (also the
    defaults of ``rtrl bench loop-offline``); ``agent``: the agent demo's smaller step."""
    band = {**DEMO_BAND, **(DEMO_AGENT_BAND if agent else {})}
    return {"RTRL_TRAINER__LR": f"{DEMO_LR:g}",
            "RTRL_TRAINER__WARMUP_STEPS": str(DEMO_WARMUP_STEPS),
            **{f"RTRL_TRAINER__BAND__{k}": v for k, v in band.items()}}


def judge_tolerance_env(agent: bool = False) -> dict[str, str]:
    """``RTRL_DEPLOYER__JUDGE_MDE`` when the deployer has that setting (else nothing: an
    unknown nested setting would be rejected); ``agent``: with the per-session metrics'."""
    if "judge_mde" in DeployerSettings.model_fields:
        mde = {**DEMO_JUDGE_MDE, **(DEMO_SESSION_MDE if agent else {})}
        return {"RTRL_DEPLOYER__JUDGE_MDE": json.dumps(mde)}
    return {}


def prepare_data_dir(data: Path) -> None:
    """Wipe a previous demo's directory (stopping its stack); refuse a foreign directory."""
    if data.exists() and any(data.iterdir()):
        if not (data / MARKER).exists():
            raise SystemExit(f"rtrl demo: {data} exists and was not made by rtrl demo; "
                             "pass --data-dir pointing at a new or previous demo directory")
        leftovers = stop_recorded(data / "pids.json")
        if leftovers:
            say(f"stopped leftovers of a previous demo run: {', '.join(leftovers)}")
        EmbeddedStack(data_dir=data / "stack").down()
        shutil.rmtree(data)
    data.mkdir(parents=True, exist_ok=True)
    (data / MARKER).write_text("made by rtrl demo; wiped by the next run\n")
