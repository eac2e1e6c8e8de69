"""Agent users (services/sim/agent.py) and the events their harness sends
(services/sim/agent_events.py), checked against the contract and the real session assembly."""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from ingest.events import EVENT_ADAPTER, SessionEnd, SessionTurn, ToolCall, ToolResult
from ingest.reward.sessions import assemble
from services.runtime.process import Stopper
from services.settings.demo import SimulatorSettings
from services.settings.model import AuthSettings, Settings
from services.sim.agent import (
    AgentSession,
    AgentWorld,
    agent_corpus,
    make_agent_world,
    read_action,
    scripted_turn,
    turn_budget,
)
from services.sim.agent_events import turn_events
from services.sim.chat_world import ChatVocab
from services.sim.simulator import Simulator
from services.sim.transport import GatewayError
from services.sim.users import make_population
from services.sim.wire import agent_chat_answer
from trainer.tokens import ASK, BOS, EOS, VOCAB_SIZE

pytestmark = pytest.mark.unit

Policy = Callable[[AgentSession, random.Random], list[int]]
AW = make_agent_world(3)
USERS = make_population(AW.world, 50, 3)


def _run(policy: Policy, n: int = 600, seed: int = 11, aw: AgentWorld = AW) -> list[AgentSession]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        s = AgentSession(aw, rng.choice(USERS), rng.choice(aw.tasks))
        while s.end is None:
            s.step(policy(s, rng), 300.0, (30, 3600), rng)
        out.append(s)
    return out


def _rate(sessions: list[AgentSession]) -> float:
    return sum(s.end == "completed" for s in sessions) / len(sessions)


def test_the_token_layout_is_disjoint_and_the_world_is_seeded() -> None:
    markers = {t.task.marker for t in AW.tasks}
    groups = [markers, set(AW.tools.values()), set(AW.progress_tokens),
              set(AW.observation_tokens.values()), set(AW.pool)]
    assert sum(len(g) for g in groups) == len(set().union(*groups)) == VOCAB_SIZE - 3
    assert all(set(t.task.preferred) <= set(AW.pool) and t.plan for t in AW.tasks)
    assert all(list(t.plan) == sorted(t.plan, key=("search", "edit", "run").index) for t in AW.tasks)
    assert make_agent_world(3) == AW and make_agent_world(4).tasks != AW.tasks


@pytest.mark.parametrize(("tokens", "kind", "reason"), [
    ("search a EOS", "call", None),
    ("run a b c EOS", "call", None),
    ("edit EOS", "call", "schema_mismatch"),
    ("edit a b c d EOS", "call", "schema_mismatch"),
    ("search a run EOS", "call", "not_json"),
    ("search a ASK EOS", "call", "not_json"),
    ("search a b", "call", "not_json"),
    ("progress a EOS", "call", "unknown_tool"),
    ("observation EOS", "call", "unknown_tool"),
    ("ASK EOS", "question", None),
    ("EOS", "empty", None),
    ("", "empty", None),
    ("a b EOS", "answer", None),
])
def test_a_completion_reads_as_one_action(tokens: str, kind: str, reason: str | None) -> None:
    names = {"EOS": EOS, "ASK": ASK, "a": AW.pool[0], "b": AW.pool[1], "c": AW.pool[2], "d": AW.pool[3],
             "progress": AW.progress_tokens[1], "observation": AW.observation_tokens["done"], **AW.tools}
    action = read_action([names[w] for w in tokens.split()], AW)
    assert (action.kind, action.invalid_reason) == (kind, reason)
    assert action.valid == (kind == "call" and reason is None)


def test_the_ideal_agent_completes_nearly_every_session_in_plan_plus_one_turns() -> None:
    sessions = _run(lambda s, r: scripted_turn(s, r, 1.0))
    assert _rate(sessions) >= 0.95
    done = [s for s in sessions if s.end == "completed"]
    assert statistics.mean(s.turn - len(s.task.plan) for s in done) < 1.2


def test_more_skill_completes_more_sessions_in_fewer_turns() -> None:
    rates, turns = [], []
    for skill in (0.2, 0.5, 0.8):
        sessions = _run(lambda s, r, k=skill: scripted_turn(s, r, k))  # type: ignore[misc]
        rates.append(_rate(sessions))
        turns.append(statistics.mean(s.turn for s in sessions if s.end == "completed"))
    assert rates[0] + 0.1 < rates[1] < rates[2] - 0.1
    assert turns[0] > turns[1] > turns[2]


def test_stalling_breaking_and_looping_agents_are_abandoned() -> None:
    cfg = AW.config
    stall = _run(lambda s, r: [ASK, EOS], n=100)
    assert all(s.end == "abandoned" and s.turn == cfg.max_questions + 1 for s in stall)
    broken = _run(lambda s, r: [AW.tools[s.task.plan[0]], EOS], n=100)
    assert all(s.end == "abandoned" and s.turn == cfg.max_invalid for s in broken)
    loop = _run(lambda s, r: [AW.tools["run"], AW.pool[-1], EOS], n=100)
    assert all(s.end == "abandoned" and s.turn <= cfg.max_repeats for s in loop)


def test_an_answer_before_the_plan_is_done_is_rejected() -> None:
    rng = random.Random(0)
    s = AgentSession(AW, USERS[0], AW.tasks[0])
    task = AW.tasks[0].task
    step = s.step([*task.preferred[:task.ideal_len], EOS], 100.0, (3600,), rng)
    assert step.outcome is not None and step.outcome.accepted is False and step.end is None
    assert s.observation == "rejected" and s.progress == 0


def test_a_session_never_outlasts_the_users_patience() -> None:
    sessions = _run(lambda s, r: [AW.tools["search"], r.choice(AW.pool), EOS], n=200)
    assert all(s.turn <= turn_budget(s.user.type, AW.config) for s in sessions)


def test_the_harness_events_are_valid_and_assemble_to_what_the_user_did() -> None:
    """Every session's events (with the gateway's session.turn per turn) pass the contract and
    assemble, by the reward worker's rules, to the session's own status and turns, with no
    anomaly."""
    sim = SimulatorSettings(time_scale=0.01)
    rng = random.Random(5)
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    for n in range(150):
        session = AgentSession(AW, rng.choice(USERS), rng.choice(AW.tasks))
        sid = f"s{n}"
        events = []
        while session.end is None:
            at = t0 + timedelta(seconds=session.turn)
            rid = f"r{n}-{session.turn}"
            events.append(SessionTurn(event_id=f"e{n}-{session.turn}", request_id=rid, ts=at,
                                      session_id=sid, turn=session.turn))
            turn = session.turn
            step = session.step(scripted_turn(session, rng, 0.5), 300.0, (30, 3600), rng)
            events += [e for _, e in turn_events(AW, sid, turn, rid, step, at, sim)]
        for e in events:
            assert EVENT_ADAPTER.validate_python(e.model_dump(mode="json")) == e
        assembled = assemble(sid, [e for e in events if hasattr(e, "session_id")],
                             t0 + timedelta(days=1))
        assert (assembled.status, len(assembled.turns)) == (session.end, session.turn)
        assert assembled.anomalies == () and assembled.set_aside == ()
        calls = [e for e in events if isinstance(e, ToolCall)]
        results = [e for e in events if isinstance(e, ToolResult)]
        assert {r.call_id for r in results} == {c.call_id for c in calls if c.outcome == "dispatched"}
        assert all(c.arguments_valid == (c.outcome == "dispatched") for c in calls)
        assert sum(isinstance(e, SessionEnd) for e in events) == 1


def test_the_agent_corpus_is_seeded_turns_of_sessions() -> None:
    pairs = agent_corpus(300, seed=3)
    assert len(pairs) == 300 and pairs == agent_corpus(300, seed=3)
    assert all(p[:2] == [BOS, p[1]] and p[1] in {t.task.marker for t in AW.tasks} for p, _ in pairs)
    kinds = {read_action(c, AW).kind for _, c in pairs}
    assert kinds == {"call", "answer"}
    starts = sum(p[3] == AW.observation_tokens["start"] for p, _ in pairs)
    assert 30 < starts < 150


class AgentGateway:
    """Answers the token-id API like GATEWAY_API.md with a scripted agent's turn (the prompt
    tells it the task and progress), or with a fixed failure status for the first ``fail``."""

    def __init__(self, aw: AgentWorld, skill: float, fail: int = 0) -> None:
        self.aw, self.skill, self.fail, self.bodies = aw, skill, fail, []  # type: ignore[var-annotated]
        self.rng = random.Random(1)

    def complete(self, body: dict[str, Any], path: str = "/v1/completions") -> tuple[int, dict[str, Any]]:
        self.bodies.append(body)
        if self.fail:
            self.fail -= 1
            return 503, {"error": "no champion model is loaded"}
        prompt = body["prompt_tokens"]
        task = next(t for t in self.aw.tasks if t.task.marker == prompt[1])
        state = AgentSession(self.aw, USERS[0], task, progress=self.aw.progress_tokens.index(prompt[2]))
        tokens = scripted_turn(state, self.rng, self.skill)
        return 200, {"request_id": body["request_id"], "model": {"name": "rtrl-policy", "version": "3"},
                     "arm": "stable", "completion_tokens": tokens, "logprobs": [-1.0] * len(tokens),
                     "latency_ms": 50.0}


def _agent_sim(gw: AgentGateway, **kw: Any) -> Simulator:
    cfg = Settings(simulator=SimulatorSettings(**{"n_users": 20, "seed": 3, "agent": True,
                                                  "rate_per_s": 0, **kw}), auth=AuthSettings())
    return Simulator(cfg, send=lambda e: None, gateway=gw)


def test_the_simulator_works_whole_sessions_one_turn_per_request() -> None:
    gw = AgentGateway(AW, 0.7)
    sim = _agent_sim(gw)
    assert sim.agent is not None
    turns = [sim.agent.one_session(n, Stopper()) for n in range(40)]
    assert len(gw.bodies) == sum(turns) == sim.requests
    by_session: dict[str, list[int]] = {}
    for body in gw.bodies:
        assert set(body) == {"user_key", "session_id", "prompt_tokens", "max_tokens", "request_id",
                             "temperature", "turn"}
        by_session.setdefault(body["session_id"], []).append(body["turn"])
    assert len(by_session) == 40 and all(t == list(range(len(t))) for t in by_session.values())
    assert len({b["request_id"] for b in gw.bodies}) == len(gw.bodies)
    ended = sim.agent.tally.ended["3"]
    assert sum(ended.values()) == 40 and ended["completed"] > 20
    assert "sessions" in sim.summary() and sim.scheduler.pending() >= 40


def test_a_refused_turn_is_tried_again_under_the_same_index_then_given_up() -> None:
    gw = AgentGateway(AW, 1.0, fail=2)
    sim = _agent_sim(gw)
    assert sim.agent is not None
    sim.agent.one_session(0, Stopper())
    assert [b["turn"] for b in gw.bodies[:3]] == [0, 0, 0]
    assert len({b["request_id"] for b in gw.bodies[:3]}) == 3
    gw.fail = 9
    with pytest.raises(GatewayError):
        sim.agent.one_session(1, Stopper())


class ChatAgentGateway(AgentGateway):
    """The same scripted agent behind OpenAI chat: it reads the user's message as words and
    writes its turn as words, ``finish_reason`` ``stop`` when the turn ended with EOS."""

    def complete(self, body: dict[str, Any], path: str = "/v1/chat/completions"
                 ) -> tuple[int, dict[str, Any]]:
        vocab = ChatVocab(self.aw.world)
        prompt = [BOS, *vocab.read(body["messages"][0]["content"])]
        status, resp = super().complete({**body, "prompt_tokens": prompt}, path)
        self.bodies[-1] = body
        if status != 200:
            return status, resp
        tokens = resp["completion_tokens"]
        choice = {"index": 0, "message": {"role": "assistant", "content": vocab.text(tokens)},
                  "finish_reason": "stop" if EOS in tokens else "length"}
        return 200, {"id": body["request_id"], "choices": [choice],
                     "rtrl": {"request_id": body["request_id"], "arm": "stable", "version": "3",
                              "latency_ms": 50.0}}


def test_agent_sessions_in_chat_name_their_turns_and_read_the_same_actions_as_in_token_ids() -> None:
    """Over chat (``rtrl demo --agent --engine vllm``'s users) a session's turns are chat
    requests that name the session and the turn, and the harness reads each answer's words as
    the action the model wrote: the same sessions end as over the token-id API."""
    ended = {}
    for api, gw in (("tokens", AgentGateway(AW, 0.6)), ("chat", ChatAgentGateway(AW, 0.6))):
        sim = _agent_sim(gw, api=api)
        assert sim.agent is not None
        turns = [sim.agent.one_session(n, Stopper()) for n in range(30)]
        ended[api] = (turns, sim.agent.tally.ended)
        if api == "chat":
            assert all(b["messages"][0]["role"] == "user" and b["turn"] == t and b["session_id"]
                       for b, t in zip(gw.bodies, [t for n in turns for t in range(n)], strict=True))
    assert ended["chat"] == ended["tokens"]
    assert set(ended["chat"][1]["3"]) >= {"completed"}


def test_an_answer_cut_off_at_max_tokens_reads_as_a_call_cut_short() -> None:
    vocab = ChatVocab(AW.world)
    tool = vocab.word(AW.tools["search"])
    said = {"content": f"{tool} {vocab.word(AW.pool[0])}"}
    resp = {"choices": [{"message": said, "finish_reason": "length"}], "rtrl": {"latency_ms": 5.0}}
    cut = agent_chat_answer(resp, "r", vocab).tokens
    assert cut == [AW.tools["search"], AW.pool[0]]
    assert read_action(cut, AW).invalid_reason == "not_json"
    resp["choices"][0]["finish_reason"] = "stop"
    assert agent_chat_answer(resp, "r", vocab).tokens == [*cut, EOS]
    assert read_action([*cut, EOS], AW).valid
