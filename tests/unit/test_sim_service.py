"""The simulator's planning and plumbing with an in-memory gateway and sink (no network)."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pydantic import BaseModel

from services.runtime.process import Stopper
from services.settings.demo import SimulatorSettings
from services.settings.model import AuthSettings, Settings
from services.sim.simulator import Simulator, plan_events, user_types_with_mix
from services.sim.transport import EventScheduler, GatewayError, RateLimiter
from services.sim.users import Outcome
from trainer.tokens import ASK, EOS

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _sim(**kw: Any) -> SimulatorSettings:
    return SimulatorSettings(**kw)


def test_accepted_edit_plans_accept_then_each_horizon_scaled() -> None:
    out = Outcome("edit", True, 40, {30: 40, 600: 30, 3600: 10}, dissatisfied=True, match=0.5)
    plan = plan_events(out, "r1", T0, _sim(time_scale=0.01, accept_delay_s=2, followup_delay_s=20))
    kinds = [(e.type, (at - T0).total_seconds()) for at, e in plan]  # type: ignore[attr-defined]
    assert kinds == [
        ("edit.accepted", pytest.approx(0.02)),
        ("edit.persistence", pytest.approx(0.32)),
        ("edit.persistence", pytest.approx(6.02)),
        ("edit.persistence", pytest.approx(36.02)),
        ("followup.dissatisfied", pytest.approx(0.22)),
    ]
    persist = [e for _, e in plan if e.type == "edit.persistence"]  # type: ignore[attr-defined]
    assert [(p.horizon_s, p.retained_chars, p.inserted_chars) for p in persist] == [  # type: ignore[attr-defined]
        (30, 40, 40), (600, 30, 40), (3600, 10, 40)]
    assert all(e.request_id == "r1" and e.ts == at for at, e in plan)  # type: ignore[attr-defined]
    assert len({e.event_id for _, e in plan}) == len(plan)  # type: ignore[attr-defined]


def test_rejected_question_and_quiet_outcomes() -> None:
    sim = _sim()
    rejected = plan_events(Outcome("edit", False, 12, {}, False, 0.1), "r", T0, sim)
    assert [e.type for _, e in rejected] == ["edit.rejected"]  # type: ignore[attr-defined]
    question = plan_events(Outcome("question", None, 0, {}, True, 0.0), "r", T0, sim)
    assert [e.type for _, e in question] == ["followup.dissatisfied"]  # type: ignore[attr-defined]
    assert plan_events(Outcome("question", None, 0, {}, False, 0.0), "r", T0, sim) == []


def test_user_mix_overrides_shares_and_rejects_unknown_names() -> None:
    types = {u.name: u.share for u in user_types_with_mix({"impatient": 0.9})}
    assert types["impatient"] == 0.9 and types["typical"] == 0.5
    with pytest.raises(ValueError, match="unknown user types"):
        user_types_with_mix({"grumpy": 1.0})


def test_scheduler_sends_in_due_order_and_drops_far_future_on_stop() -> None:
    sent: list[str] = []

    class E(BaseModel):
        type: str = "x"
        name: str

    def send(e: BaseModel) -> None:
        assert isinstance(e, E)
        sent.append(e.name)

    sched = EventScheduler(send)
    now = datetime.now(UTC)
    sched.schedule(now + timedelta(seconds=0.2), E(name="b"))
    sched.schedule(now, E(name="a"))
    sched.schedule(now + timedelta(hours=1), E(name="late"))
    stopper = Stopper()
    t = threading.Thread(target=sched.run, args=(stopper, 1.0))
    t.start()
    time.sleep(0.5)
    stopper.stop()
    t.join(5)
    assert not t.is_alive()
    assert sent == ["a", "b"] and sched.pending() == 0


def test_rate_limiter_spaces_calls() -> None:
    lim, stopper = RateLimiter(50.0), Stopper()
    t0 = time.monotonic()
    for _ in range(11):
        lim.wait(stopper)
    assert time.monotonic() - t0 >= 0.19


class FakeGateway:
    """Answers like GATEWAY_API.md: a fixed completion from version 3."""

    def __init__(self, tokens: list[int], status: int = 200) -> None:
        self.tokens, self.status, self.bodies = tokens, status, []  # type: ignore[var-annotated]

    def complete(self, body: dict[str, Any], path: str = "/v1/completions") -> tuple[int, dict[str, Any]]:
        self.bodies.append(body)
        if self.status != 200:
            return self.status, {"error": "no champion model is loaded"}
        return 200, {
            "request_id": body["request_id"], "model": {"name": "rtrl-policy", "version": "3"},
            "arm": "stable", "completion_tokens": self.tokens, "logprobs": [-1.0] * len(self.tokens),
            "completion_kind": "question" if self.tokens[:1] == [ASK] else "edit",
            "latency_ms": 50.0, "tool_calls": 0, "invalid_tool_calls": 0,
        }


def _settings(**sim: Any) -> Settings:
    return Settings(simulator=SimulatorSettings(**{"n_users": 20, "seed": 4, **sim}),
                    auth=AuthSettings())


def test_simulator_requests_follow_the_contract_and_schedule_feedback() -> None:
    gw = FakeGateway([20, 21, 22, EOS])
    sim = Simulator(_settings(max_tokens=12, time_scale=0.001), send=lambda e: None, gateway=gw)
    for n in range(30):
        sim.one_request(n)
    body = gw.bodies[0]
    assert set(body) == {"user_key", "session_id", "prompt_tokens", "max_tokens", "request_id",
                         "temperature"}
    assert body["max_tokens"] == 12 and body["user_key"].startswith("sim-u")
    assert sim.scheduler.pending() >= 30  # every edit gets accepted or rejected
    assert sum(sim.tally.served.values()) == 30


def test_simulator_is_deterministic_in_the_seed() -> None:
    def users(seed: int) -> list[str]:
        gw = FakeGateway([20, EOS])
        sim = Simulator(_settings(seed=seed), send=lambda e: None, gateway=gw)
        for n in range(10):
            sim.one_request(n)
        return [b["user_key"] + str(b["prompt_tokens"]) for b in gw.bodies]

    assert users(1) == users(1) and users(1) != users(2)


def test_gateway_errors_are_raised_with_status() -> None:
    sim = Simulator(_settings(), send=lambda e: None, gateway=FakeGateway([EOS], status=503))
    with pytest.raises(GatewayError) as err:
        sim.one_request(0)
    assert err.value.status == 503 and sim.tally.errors == 1


class ChatGateway:
    """Answers ``/v1/chat/completions`` like the gateway's OpenAI API (docs/gateway.md)."""

    def __init__(self, text: str) -> None:
        self.text, self.calls = text, []  # type: ignore[var-annotated]

    def complete(self, body: dict[str, Any], path: str = "/v1/completions") -> tuple[int, dict[str, Any]]:
        self.calls.append((path, body))
        return 200, {"id": body["request_id"], "object": "chat.completion",
                     "choices": [{"index": 0, "message": {"role": "assistant", "content": self.text},
                                  "finish_reason": "stop"}],
                     "rtrl": {"request_id": body["request_id"], "arm": "canary", "version": "4",
                              "latency_ms": 120.0}}


def test_chat_users_write_words_and_read_the_answer() -> None:
    from services.sim.chat_world import ASK_WORD, ChatVocab

    gw = ChatGateway("loop cache sort")
    sim = Simulator(_settings(api="chat", max_tokens=9, temperature=0.7), send=lambda e: None, gateway=gw)
    for n in range(20):
        sim.one_request(n)
    path, body = gw.calls[0]
    assert path == "/v1/chat/completions"
    assert set(body) == {"messages", "user", "request_id", "max_tokens", "temperature"}  # no agent session
    assert body["max_tokens"] == 9 and body["temperature"] == 0.7 and body["user"].startswith("sim-u")
    [message] = body["messages"]
    vocab = ChatVocab(sim.world)
    assert message["role"] == "user" and sim.world.task_for_marker(vocab.read(message["content"])[0])
    assert sim.tally.served == {"4": 20} and sim.scheduler.pending() >= 20
    asks = ChatGateway(f"{ASK_WORD} file do you mean?")
    sim = Simulator(_settings(api="chat"), send=lambda e: None, gateway=asks)
    for n in range(10):
        sim.one_request(n)
    assert sim.tally.questions == {"4": 10}


@pytest.mark.parametrize("resp", [
    {"choices": [{"message": {"content": "loop"}}], "rtrl": {"arm": "stable", "version": "1"}},
    {"choices": [], "rtrl": {"latency_ms": 1.0}},
    {"choices": [{"message": {"content": "loop"}}], "rtrl": {"latency_ms": "slow"}},
    {"error": "not an answer"},
    ["not", "an", "object"],
])
def test_a_malformed_chat_answer_is_a_gateway_error_not_a_dead_user(resp: Any) -> None:
    class Odd(ChatGateway):
        def complete(self, body: dict[str, Any], path: str = "/v1/completions") -> tuple[int, Any]:
            return 200, resp

    sim = Simulator(_settings(api="chat"), send=lambda e: None, gateway=Odd(""))
    with pytest.raises(GatewayError, match="malformed answer"):
        sim.one_request(0)
    assert sim.tally.errors == 1 and sim.scheduler.pending() == 0


def test_a_chat_answer_is_read_from_the_message_and_the_rtrl_extension() -> None:
    from services.sim.chat_world import ChatVocab
    from services.sim.simulator import chat_answer

    vocab = ChatVocab(Simulator(_settings(), send=lambda e: None, gateway=ChatGateway("")).world)
    resp: dict[str, Any] = {"choices": [{"message": {"content": "loop"}}],
                            "rtrl": {"arm": "stable", "version": "1"}}
    resp["rtrl"]["latency_ms"] = 10.0
    answer = chat_answer(resp, "r1", vocab)
    assert (answer.request_id, answer.arm, answer.version, answer.latency_ms) == ("r1", "stable", "1", 10.0)
    assert answer.tokens == vocab.read("loop")
