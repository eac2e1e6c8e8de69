"""Agent sessions through the real gateway (``simulator.agent = true``).

A worker thread works one whole session at a time (services/sim/agent.py): each turn is a
request that names the session and its turn (the gateway logs the turn's ``session.turn``):
a token-id request, or with ``simulator.api = chat`` an OpenAI chat request whose message is
the turn's prompt in words (services/sim/chat_world.py, as ``rtrl demo --engine vllm``'s
users speak to a real LLM; the answer's words are read back as the world's ids). The user's
harness reads the answer as an action and sends the session's
client events (services/sim/agent_events.py) through the simulator's scheduler. A turn the
gateway refuses is tried again (same turn index, a new request id) up to
:data:`TURN_ATTEMPTS` times; after that the session is left as it is, and the reward worker
closes it as ``timed_out``.
"""

from __future__ import annotations

import random
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from ingest.contracts.prometheus import SIM_REQUESTS
from services.runtime.process import Stopper
from services.settings.demo import SimulatorSettings
from services.sim.agent import AgentSession, AgentWorld, make_agent_world
from services.sim.agent_events import turn_events
from services.sim.chat_world import ChatVocab
from services.sim.transport import EventScheduler, Gateway, GatewayError, RateLimiter
from services.sim.users import SimUser
from services.sim.wire import Answer, agent_chat_answer, agent_chat_request, token_answer, token_request

TURN_ATTEMPTS = 3


@dataclass
class SessionTally:
    """Sessions per version of their first turn, by how they ended (for the progress log)."""

    ended: dict[str, dict[str, int]] = field(default_factory=dict)
    turns: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, version: str, end: str, turns: int) -> None:
        with self.lock:
            by_end = self.ended.setdefault(version, {})
            by_end[end] = by_end.get(end, 0) + 1
            self.turns[version] = self.turns.get(version, 0) + turns

    def summary(self) -> str:
        with self.lock:
            parts = []
            for v, by_end in sorted(self.ended.items()):
                n = sum(by_end.values())
                done = by_end.get("completed", 0)
                parts.append(f"v{v}: {n} sessions, {done / n:.0%} completed, "
                             f"{self.turns[v] / n:.1f} turns each")
        return "; ".join(parts) or "no session ended yet"


class AgentDriver:
    """Runs simulated agent sessions against the gateway."""

    def __init__(self, sim: SimulatorSettings, users: Sequence[SimUser], gateway: Gateway,
                 scheduler: EventScheduler, limiter: RateLimiter, horizons: Sequence[int],
                 on_turn: Callable[[], None] = lambda: None) -> None:
        self.sim = sim
        self.aw: AgentWorld = make_agent_world(sim.seed)
        self.vocab = ChatVocab(self.aw.world)
        self.users = list(users)
        self.gateway = gateway
        self.scheduler = scheduler
        self.limiter = limiter
        self.horizons = tuple(horizons)
        self.on_turn = on_turn
        self.tally = SessionTally()

    def _serve(self, session_id: str, session: AgentSession, prompt: list[int], n: int,
               stopper: Stopper) -> tuple[Answer, datetime] | None:
        """One turn served (None when stopping); GatewayError after the last failed attempt."""
        for attempt in range(TURN_ATTEMPTS):
            self.limiter.wait(stopper)
            if stopper.stopping:
                return None
            request_id = f"sim-{self.sim.seed}-a{n}-t{session.turn}-{uuid.uuid4().hex[:8]}"
            if self.sim.api == "chat":
                path, body = agent_chat_request(prompt, session.user.key, session_id, session.turn,
                                                request_id, self.sim, self.vocab)
            else:
                path, body = token_request(prompt, session.user.key, session_id, request_id, self.sim)
                body["turn"] = session.turn
            served_at = datetime.now(UTC)
            status, resp = self.gateway.complete(body, path)
            if status == 200:
                try:
                    answer = (agent_chat_answer(resp, request_id, self.vocab) if self.sim.api == "chat"
                              else token_answer(resp, request_id))
                except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
                    raise GatewayError(status, f"malformed answer ({exc}): {resp!r:.200}") from None
                SIM_REQUESTS.labels(arm=answer.arm, code="200").inc()
                return answer, served_at
            SIM_REQUESTS.labels(arm="none", code=str(status)).inc()
            if attempt == TURN_ATTEMPTS - 1:
                raise GatewayError(status, str(resp.get("error", resp)))
            stopper.wait(0.2 * 2**attempt)
        return None

    def one_session(self, n: int, stopper: Stopper) -> int:
        """Session ``n`` from its first turn to its end (or the stop); the turns it served."""
        rng = random.Random(f"{self.sim.seed}-session-{n}")
        user = rng.choice(self.users)
        session = AgentSession(self.aw, user, rng.choice(self.aw.tasks))
        session_id = f"sim-{self.sim.seed}-s{n}-{uuid.uuid4().hex[:8]}"
        first_version = "?"
        while session.end is None:
            prompt = session.prompt(rng)
            served = self._serve(session_id, session, prompt, n, stopper)
            if served is None:
                return session.turn
            answer, served_at = served
            if session.turn == 0:
                first_version = answer.version
            turn = session.turn
            step = session.step(answer.tokens, answer.latency_ms, self.horizons, rng)
            for at, event in turn_events(self.aw, session_id, turn, answer.request_id, step,
                                         served_at, self.sim):
                self.scheduler.schedule(at, event)
            self.on_turn()
        self.tally.add(first_version, session.end, session.turn)
        return session.turn
