"""The demo's processes: the embedded stack, the connections the demo watches the loop
through, the bootstrap, the services, and stopping them all again."""

from __future__ import annotations

import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import redis

from deployer.adapters.redis_state import ControllerState
from deployer.operators import sign
from deployer.registry import Registry
from deployer.status import Command
from services.demo.config import DEMO_OPERATOR, DemoConfig, DemoPlan
from services.demo.console import say
from services.runtime.kafka_io import ensure_topics
from services.runtime.redis_io import make_redis
from services.settings.model import Settings
from services.sim.agent import AgentWorld, make_agent_world
from services.sim.users import World, make_world
from services.stack.embedded import EmbeddedStack, free_port
from services.stack.supervisor import ProcSpec, RewardsTracker, Supervisor, module_available, serve_argv

SERVICES: tuple[tuple[str, str], ...] = (
    ("ingest", "services.serve_ingest"),
    ("reward", "services.serve_reward"),
    ("gateway", "services.serve_gateway"),
    ("trainer", "services.serve_trainer"),
    ("deployer", "services.serve_deployer"),
    ("simulator", "services.sim.simulator"),
)
"""(service, module) in start order; stopped in reverse (users first, stack last)."""
STOP_ORDER: tuple[str | tuple[str, ...], ...] = (
    "simulator", ("gateway", "deployer", "trainer"), "reward", "ingest")
"""Users first; then the gateway (flushing its served events), the deployer and the trainer
together (the trainer's Ray shutdown takes the longest and holds up no one); then the
reward worker and ingest, which drain what the others wrote."""


def new_stack(data: Path) -> EmbeddedStack:
    """A private embedded stack (broker, Redis, MLflow) on free ports under ``data``."""
    return EmbeddedStack(
        data_dir=data / "stack", kafka_port=free_port(), redis_port=free_port(),
        mlflow_port=free_port(), reuse_redis_url=None, with_mlflow=True,
    )


def start_stack(stack: EmbeddedStack) -> None:
    say(f"starting the embedded stack in {stack.data_dir} (broker, Redis, MLflow) ...")
    t = time.monotonic()
    stack.up(timeout_s=120)
    say(f"stack ready in {time.monotonic() - t:.0f}s: kafka {stack.kafka_bootstrap}, "
        f"redis {stack.redis_url}, mlflow {stack.mlflow_uri}")


def stop_stack(stack: EmbeddedStack, keep: bool) -> None:
    if keep:
        say(f"stack kept running (--keep-stack): MLflow {stack.mlflow_uri}; stop it with "
            f"RTRL_STACK__DATA_DIR={stack.data_dir} rtrl down")
        return
    stopped = stack.down()
    say(f"stack stopped: {', '.join(stopped) or 'nothing was running'}")


class LazyRegistry:
    """The model registry in the demo's MLflow, opened on first use (mlflow is slow to import)."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._registry: Registry | None = None

    def __call__(self) -> Registry:
        if self._registry is None:
            from deployer.adapters.mlflow_registry import MlflowRegistry

            m = self._settings.mlflow
            self._registry = MlflowRegistry(m.tracking_uri, m.registered_model, m.training_experiment,
                                            m.deployments_experiment)
        return self._registry


@dataclass(frozen=True)
class Live:
    """What the demo runs and watches the loop through, once configured."""

    settings: Settings
    supervisor: Supervisor
    """Starts and stops the service processes (their logs in ``<data>/logs``)."""
    redis: redis.Redis
    tracker: RewardsTracker
    """Every reward record on the rewards topic, as it comes."""
    world: World | AgentWorld
    """The simulated users' world (the bad candidate is trained on its prompts): the agent
    world under ``--agent``."""
    registry: LazyRegistry


def connect(plan: DemoPlan, config: DemoConfig) -> Live:
    """Create the topics, then the supervisor, Redis and the rewards tracker (started)."""
    settings = config.settings
    ensure_topics(settings)
    supervisor = Supervisor(plan.data / "logs", config.env, pid_file=plan.data / "pids.json")
    client = make_redis(settings.redis)
    world = make_agent_world(plan.demo.seed) if plan.demo.agent else make_world(plan.demo.seed)
    tracker = RewardsTracker(settings, config.primary_horizon).start()
    return Live(settings=settings, supervisor=supervisor, redis=client, tracker=tracker, world=world,
                registry=LazyRegistry(settings))


def bootstrap(live: Live, corpus: Path, notes: list[str], args: tuple[str, ...] = ("--epochs", "2"),
              ) -> str | None:
    """``rtrl bootstrap --corpus`` with ``args``: the first champion's version, or None (said
    and noted)."""
    if not module_available("services.wiring.trainer"):
        say("UNAVAILABLE: rtrl bootstrap (services/wiring/trainer.py missing): no first champion, "
            "the loop cannot run")
        return None
    say("bootstrapping the first champion (supervised run on the corpus) ...")
    t = time.monotonic()
    spec = ProcSpec("bootstrap", [sys.executable, "-m", "services.cli", "bootstrap",
                                  "--corpus", str(corpus), *args])
    rc = live.supervisor.run(spec, timeout_s=900)
    if rc != 0:
        say(f"bootstrap failed (exit {rc}):\n{live.supervisor.log_tail('bootstrap')}")
        notes.append(f"rtrl bootstrap failed with exit code {rc}.")
        return None
    version = live.registry().alias_version("champion")
    say(f"bootstrap champion v{version} registered in {time.monotonic() - t:.0f}s")
    return version


def pin_holdout(live: Live, config: DemoConfig, version: str, share: float) -> None:
    """Queue the signed command that holds ``share`` of the users out on ``version`` for the
    run; the deployer executes it on its first tick (docs/holdout.md)."""
    cmd = Command(id=uuid.uuid4().hex, kind="holdout_pin", by=DEMO_OPERATOR, version=version, share=share,
                  days=1.0, reason="the demo's long-term holdout: the loop's total effect, same minutes")
    ControllerState(live.redis, config.settings.redis.key_prefix).push(
        sign(cmd, config.operator_token, time.time()))
    say(f"holdout: {share:.0%} of the users stay on v{version} for the whole run (rtrl holdout pin, "
        "applied on the deployer's first tick)")


def start_services(supervisor: Supervisor, gateway_port: int, notes: list[str]) -> None:
    """Every service of SERVICES that is installed, each its own process; the users once the
    gateway is ready."""
    unavailable = []
    for name, module in SERVICES:
        if not module_available(module):
            unavailable.append(f"{name} ({module.replace('.', '/')}.py is not installed)")
            say(f"UNAVAILABLE: rtrl serve {name} ({module} missing); the loop runs without it")
            continue
        if name == "simulator" and "gateway" in supervisor.procs:
            wait_gateway(gateway_port, supervisor.log_dir / "gateway.log")
        supervisor.start(ProcSpec(name, serve_argv(name)))
    running = [n for n in supervisor.procs]
    say(f"services started: {', '.join(running)}; gateway on http://127.0.0.1:{gateway_port}")
    if unavailable:
        notes.append("Unavailable in this run: " + "; ".join(unavailable))


def wait_gateway(port: int, log: Path, timeout_s: float = 90.0) -> None:
    """Until the gateway answers /readyz (it has loaded the champion), or the timeout."""
    url = f"http://127.0.0.1:{port}/readyz"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    say(f"the gateway is not ready after {timeout_s:.0f}s; starting the users anyway (see {log})")


def stop_services(supervisor: Supervisor) -> None:
    say("stopping services (SIGTERM, then SIGKILL after a grace period) ...")
    codes = supervisor.stop_all(grace_s=20, order=STOP_ORDER)
    done = ", ".join(f"{n} (exit {rc})" for n, rc in codes.items() if rc is not None)
    say(f"stopped: {done or 'nothing was running'}")
