"""``rtrl serve simulator``: simulated users that use the product through the real gateway.

Each worker thread picks a user and a task (services/sim/users.py), asks the gateway for a
completion over HTTP (the token-id API of GATEWAY_API.md, or with ``simulator.api = chat``
OpenAI chat completions in words, services/sim/chat_world.py), lets the user react, and
schedules the client events of the contract at compressed times:

    edit.accepted / edit.rejected   accept_delay_s after the completion
    edit.persistence                at each horizon of the reward spec after acceptance
    followup.dissatisfied           followup_delay_s after the reaction

With ``simulator.agent`` each worker works whole agent sessions instead: multi-step tasks
that need tools, one request per turn (services/sim/agent_run.py).

All delays are multiplied by ``simulator.time_scale`` (use the same value as
``reward.time_scale``), so a 1 h horizon can pass in seconds. Events are signed and sent to
the raw topic through EventProducer, like any client's. Everything random is seeded from
``simulator.seed`` and the request's sequence number.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel

from ingest.contracts.prometheus import BUILD_INFO, SIM_REQUESTS, registry_for
from ingest.reward.spec import load_spec
from services.runtime.event_producer import EventProducer
from services.runtime.health import Health, HttpEndpoints
from services.runtime.process import Stopper, setup_logging
from services.settings.model import Settings, get_settings
from services.sim.agent_run import AgentDriver
from services.sim.chat_world import ChatVocab
from services.sim.transport import (
    EventScheduler,
    Gateway,
    GatewayClient,
    GatewayError,
    RateLimiter,
)
from services.sim.users import (
    DEFAULT_USER_TYPES,
    Outcome,
    SimUser,
    Task,
    UserType,
    World,
    WorldConfig,
    draw_task,
    make_population,
    make_prompt,
    make_world,
    react,
)
from services.sim.wire import chat_answer, chat_request, plan_events, token_answer, token_request

log = logging.getLogger("rtrl.simulator")


# --------------------------------------------------------------------------- pure planning


def user_types_with_mix(mix: dict[str, float]) -> tuple[UserType, ...]:
    """The default user types with their shares overridden by name."""
    known = {u.name for u in DEFAULT_USER_TYPES}
    unknown = set(mix) - known
    if unknown:
        raise ValueError(
            f"unknown user types in simulator.user_mix: {sorted(unknown)}; known: {sorted(known)}"
        )
    return tuple(
        UserType(**{**u.__dict__, "share": float(mix.get(u.name, u.share))}) for u in DEFAULT_USER_TYPES
    )


# --------------------------------------------------------------------------- the service


@dataclass
class Tally:
    """Running counts per served version (for the progress log)."""

    served: dict[str, int] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)
    questions: dict[str, int] = field(default_factory=dict)
    errors: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, version: str, outcome: Outcome) -> None:
        with self.lock:
            self.served[version] = self.served.get(version, 0) + 1
            self.accepted[version] = self.accepted.get(version, 0) + int(outcome.accepted is True)
            self.questions[version] = self.questions.get(version, 0) + int(outcome.kind == "question")

    def summary(self) -> str:
        with self.lock:
            parts = [
                f"v{v}: {n} served, {self.accepted[v] / n:.0%} accepted, "
                f"{self.questions[v] / n:.0%} questions"
                for v, n in sorted(self.served.items())
            ]
        return "; ".join(parts) + f"; errors {self.errors}"


class Simulator:
    def __init__(self, settings: Settings, send: Callable[[BaseModel], object],
                 gateway: Gateway | None = None) -> None:
        sim = settings.simulator
        self.settings = settings
        self.sim = sim
        cfg = WorldConfig(ambiguous_share=sim.ambiguous_share)
        self.world: World = make_world(sim.seed, cfg, user_types_with_mix(sim.user_mix))
        self.users: list[SimUser] = make_population(self.world, sim.n_users, sim.seed)
        self.horizons = tuple(load_spec(settings.reward_spec).persistence.horizons_s)
        self.vocab = ChatVocab(self.world)
        self.gateway: Gateway = gateway or GatewayClient(
            sim.gateway_url, sim.request_timeout_s,
            sim.api_key.get_secret_value() if sim.api_key is not None else None)
        self.scheduler = EventScheduler(send)
        self.limiter = RateLimiter(sim.rate_per_s)
        self.tally = Tally()
        self._seq = itertools.count()
        self.last_ok = 0.0
        self.requests = 0
        self.agent: AgentDriver | None = None
        if sim.agent:
            self.agent = AgentDriver(sim, self.users, self.gateway, self.scheduler, self.limiter,
                                     self.horizons, self._turn_served)

    def _turn_served(self) -> None:
        self.last_ok = time.monotonic()
        with self.tally.lock:
            self.requests += 1

    def one_request(self, n: int) -> None:
        """Request ``n``: pick a user and task, call the gateway, schedule the reaction."""
        rng = random.Random(f"{self.sim.seed}-req-{n}")
        user = rng.choice(self.users)
        task: Task = draw_task(self.world, rng)
        prompt = make_prompt(task, self.world, rng)
        request_id = f"sim-{self.sim.seed}-{n}-{uuid.uuid4().hex[:8]}"
        if self.sim.api == "chat":
            path, body = chat_request(prompt, user.key, request_id, self.sim, self.vocab)
        else:
            path, body = token_request(prompt, user.key, f"{user.key}-s{n // 50}", request_id, self.sim)
        served_at = datetime.now(UTC)
        status, resp = self.gateway.complete(body, path)
        if status != 200:
            SIM_REQUESTS.labels(arm="none", code=str(status)).inc()
            with self.tally.lock:
                self.tally.errors += 1
            raise GatewayError(status, str(resp.get("error", resp)))
        try:
            answer = (chat_answer(resp, request_id, self.vocab) if self.sim.api == "chat"
                      else token_answer(resp, request_id))
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            with self.tally.lock:
                self.tally.errors += 1
            raise GatewayError(status, f"malformed answer ({type(exc).__name__}: {exc}): {resp!r:.200}") \
                from None
        SIM_REQUESTS.labels(arm=answer.arm, code="200").inc()
        self.last_ok = time.monotonic()
        outcome = react(user, task, answer.tokens, answer.latency_ms, self.horizons, self.world, rng)
        self.tally.add(answer.version, outcome)
        for at, event in plan_events(outcome, answer.request_id, served_at, self.sim):
            self.scheduler.schedule(at, event)

    def worker(self, stopper: Stopper) -> None:
        backoff = 0.2
        while not stopper.stopping:
            if self.agent is None:
                self.limiter.wait(stopper)
            if stopper.stopping:
                return
            n = next(self._seq)
            if self.sim.max_requests and n >= self.sim.max_requests:
                return
            try:
                if self.agent is not None:
                    self.agent.one_session(n, stopper)
                else:
                    self.one_request(n)
                    self.requests += 1
                backoff = 0.2
            except GatewayError as exc:
                if self.agent is not None:  # one_request counts its own
                    with self.tally.lock:
                        self.tally.errors += 1
                level = logging.INFO if exc.status == 503 else logging.WARNING
                log.log(level, "gateway answered %s: %s", exc.status, exc.message)
                stopper.wait(backoff)
                backoff = min(5.0, backoff * 2)
            except (OSError, http.client.HTTPException) as exc:
                with self.tally.lock:
                    self.tally.errors += 1
                log.warning("gateway unreachable at %s: %s", self.sim.gateway_url, exc)
                stopper.wait(backoff)
                backoff = min(5.0, backoff * 2)

    def run(self, stopper: Stopper, health: Health | None = None, log_every_s: float = 10.0) -> None:
        """Run the workers until stopped (or max_requests), then send what is still due."""
        workers = [
            threading.Thread(target=self.worker, args=(stopper,), name=f"sim-{i}", daemon=True)
            for i in range(self.sim.concurrency)
        ]
        sched_stop = Stopper()
        sender = threading.Thread(target=self.scheduler.run, args=(sched_stop,), name="sim-events",
                                  daemon=True)
        sender.start()
        for w in workers:
            w.start()
        last_log = time.monotonic()
        while any(w.is_alive() for w in workers):
            if health is not None:
                health.beat()
            stopper.wait(0.5)
            if time.monotonic() - last_log >= log_every_s:
                log.info("%d requests, %d events pending; %s", self.requests,
                         self.scheduler.pending(), self.summary())
                last_log = time.monotonic()
        for w in workers:
            w.join()
        # Events due soon are still sent; a stop does not wait for uncompressed 1 h horizons.
        sched_stop.stop()
        sender.join()
        log.info("simulator done: %d requests; %s", self.requests, self.summary())

    def summary(self) -> str:
        if self.agent is None:
            return self.tally.summary()
        return f"{self.agent.tally.summary()}; errors {self.tally.errors}"


def _secret(settings: Settings) -> bytes | None:
    sim = settings.simulator
    if sim.key_id is None:
        return None
    if sim.secret is not None:
        return sim.secret.get_secret_value().encode()
    key = settings.auth.keys.get(sim.key_id)
    if key is None:
        raise SystemExit(
            f"simulator: no secret for key id {sim.key_id!r}: set RTRL_SIMULATOR__SECRET, add it to "
            "RTRL_AUTH__KEYS, or set RTRL_SIMULATOR__KEY_ID= (empty) to send unsigned events (dev)"
        )
    return key.get_secret_value().encode()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rtrl serve simulator", description=__doc__.split("\n")[0])
    parser.add_argument("--max-requests", type=int, help="stop after this many requests")
    parser.add_argument("--rate", type=float, help="requests per second (0: as fast as possible)")
    parser.add_argument("--gateway-url", help="gateway base URL (default: simulator.gateway_url)")
    args = parser.parse_args(argv)
    settings = get_settings()
    overrides: dict[str, Any] = {}
    if args.max_requests is not None:
        overrides["max_requests"] = args.max_requests
    if args.rate is not None:
        overrides["rate_per_s"] = args.rate
    if args.gateway_url:
        overrides["gateway_url"] = args.gateway_url
    if overrides:
        settings = settings.model_copy(
            update={"simulator": settings.simulator.model_copy(update=overrides)})
    setup_logging(settings.log_level, "simulator")
    BUILD_INFO.info({"rtrl_service": "simulator"})
    stopper = Stopper().install()
    producer = EventProducer(settings, settings.simulator.key_id, _secret(settings))
    sim = Simulator(settings, producer.send)
    health = Health()
    health.add_check("gateway_answered_recently", lambda: time.monotonic() - sim.last_ok < 30)
    endpoints = HttpEndpoints(health, settings.http.host, settings.http.port,
                              registry_for("simulator")).start()
    log.info("simulating %d users against %s at %s req/s (time scale %g)", len(sim.users),
             settings.simulator.gateway_url, settings.simulator.rate_per_s or "max",
             settings.simulator.time_scale)
    try:
        sim.run(stopper, health)
    finally:
        producer.flush(10)
        producer.close(10)
        endpoints.stop()
    return 0
