"""Agent sessions end to end, as a team would run them: an agent harness on the official
``openai`` client drives multi-turn tool-calling sessions through the gateway (naming its
session, sending each call's result back in the history), and sends what only it knows
(``tool.result``, ``session.end``, a rejected edit) to ingest. A real ingest worker and
reward worker processes with the agent spec run against the broker and Redis; the reward
workers are SIGKILLed at both stages' commit points and at random moments while the
sessions run. In the end every served turn has exactly one reward record carrying its
session's credit, and ``rtrl reconcile --strict`` finds nothing lost, duplicated or
unreflected.

The engine is bench/fake_engine.py (tool calls whose arguments are the last user message,
so the harness decides which are valid); tests/integration/test_gateway_vllm.py drives
sessions against a real vLLM."""

from __future__ import annotations

import collections
import random
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import openai
import pytest
from pydantic import SecretStr
from reward_helpers import kill_rounds, read_rewards
from session_helpers import AGENT_SPEC

from bench.fake_engine import FakeEngine
from ingest.events import EditRejected, SessionEnd, ToolResult
from ingest.reward.session_credit import COMPONENTS
from services.gateway.asgi.app import GatewayServer
from services.runtime.event_producer import EventProducer
from services.runtime.health import Health
from services.runtime.kafka_io import ensure_topics
from services.settings.model import AuthSettings, Settings
from services.settings.services import GatewaySettings, IngestSettings, RewardSettings, UpstreamSettings
from services.wiring.gateway import build
from tests.reliability.workload import KEY_ID, RTRL, SECRET, Worker, env_for, kill_alive, wait_up

pytestmark = [pytest.mark.integration, pytest.mark.reliability, pytest.mark.timeout(420)]

API_KEY = "sk-agent-e2e"
SCALE = "0.005"
"""The reward workers' time scale: a tool-call turn closes 0.3 s after it was seen, a text
turn's window 18 s, an idle session 9 s."""
READ: Any = {"type": "function", "function": {"name": "read_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"],
    "additionalProperties": False}}}


class Harness:
    """An agent's harness: runs sessions through the gateway with the openai client and sends
    the events only it can see, signed, to the raw topic."""

    def __init__(self, client: openai.OpenAI, events: EventProducer, rng: random.Random) -> None:
        self.client, self.events, self.rng = client, events, rng
        self.served: dict[str, str] = {}  # request id -> session id
        self.ended: dict[str, str] = {}  # session id -> outcome
        self.invalid: dict[str, int] = {}  # request id -> invalid calls made
        self.errors: list[BaseException] = []

    def session(self, sid: str) -> None:
        rng, history = self.rng, []
        turns = rng.randint(1, 4)
        text_last = rng.random() < 0.4
        for t in range(turns):
            rid = f"{sid}-r{t}"
            calling = not (text_last and t == turns - 1)
            valid = rng.random() > 0.3
            history.append({"role": "user", "content": '{"path": "src/app.py"}' if valid else "open app.py"})
            kw: dict[str, Any] = {"tools": [READ]} if calling else {}
            answer: Any = self.client.chat.completions.create(
                model="team-model", user=f"dev-{sid}", messages=history, stream=rng.random() < 0.3,
                extra_body={"session_id": sid, "request_id": rid}, **kw)
            self.served[rid] = sid
            if hasattr(answer, "choices"):
                message = answer.choices[0].message
                calls = [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []]
            else:  # streamed: the call's id and name come first, its arguments in pieces
                deltas = [c.choices[0].delta for c in answer if c.choices and c.choices[0].delta.tool_calls]
                pieces = "".join(d.tool_calls[0].function.arguments or "" for d in deltas)
                calls = [(deltas[0].tool_calls[0].id, deltas[0].tool_calls[0].function.name, pieces)
                         ] if deltas else []
            assert bool(calls) == calling, (rid, calls)
            if not calling:
                if rng.random() < 0.5:  # the user rejects the proposed edit: its window closes now
                    self.send(EditRejected(event_id=uuid.uuid4().hex, request_id=rid, ts=_now()))
                continue
            self.invalid[rid] = 0 if valid else 1
            for call_id, name, arguments in calls:
                history.append({"role": "assistant", "content": None, "tool_calls": [
                    {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]})
                history.append({"role": "tool", "tool_call_id": call_id, "content": "print('hello')"})
                self.send(ToolResult(event_id=uuid.uuid4().hex, request_id=rid, ts=_now(), session_id=sid,
                                     turn=t, call_id=call_id, status="ok" if valid else "error",
                                     result_tokens=6))
            time.sleep(rng.uniform(0.05, 0.4))
        if rng.random() < 0.8:  # else it times out
            outcome = rng.choice(["completed", "completed", "abandoned", "handed_back"])
            self.ended[sid] = outcome
            self.send(SessionEnd(event_id=uuid.uuid4().hex, request_id=f"{sid}-r{turns - 1}", ts=_now(),
                                 session_id=sid, turn=turns - 1, outcome=outcome))  # type: ignore[arg-type]

    def send(self, event: Any) -> None:
        self.events.send(event)
        self.events.flush(10)

    def run(self, sessions: list[str]) -> None:
        try:
            for sid in sessions:
                self.session(sid)
        except BaseException as exc:  # reported by the test
            self.errors.append(exc)


def _now() -> datetime:
    return datetime.now(UTC)


@pytest.fixture
def gateway(isolated_settings: Settings) -> Iterator[tuple[openai.OpenAI, Settings]]:
    """The gateway in this process, signing its events as the harness's ingest expects."""
    s = isolated_settings
    engine = FakeEngine(token_ms=1.0).start()
    cfg = s.model_copy(update={
        "auth": AuthSettings(keys={KEY_ID: SecretStr(SECRET)}),
        "ingest": IngestSettings(group_id=f"ingest-{s.topics.raw}"),
        "reward": RewardSettings(group_id=f"reward-{s.topics.raw}", time_scale=float(SCALE)),
        "gateway": GatewaySettings(**{
            "port": 0, "key_id": KEY_ID, "api_keys": {"team": SecretStr(API_KEY)},
            "stable_upstream": UpstreamSettings(base_url=engine.url, model="team-model")})})
    ensure_topics(cfg)
    gw, parts = build(cfg, Health())
    server = GatewayServer(gw, "127.0.0.1", 0).start()
    deadline = time.monotonic() + 10
    while gw.slots.get("stable") is None:
        assert time.monotonic() < deadline, "the upstream never became available"
        time.sleep(0.05)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=API_KEY, max_retries=0,
                           timeout=30)
    try:
        yield client, cfg
    finally:
        client.close()
        server.stop()
        for part in parts:
            part.stop()
        engine.stop()


def test_sessions_through_the_gateway_get_one_reward_per_turn_across_reward_sigkills(
        gateway: tuple[openai.OpenAI, Settings], tmp_path: Path) -> None:
    client, s = gateway
    env = env_for(s, tmp_path, RTRL_REWARD__TIME_SCALE=SCALE, RTRL_REWARD__TRANSACTION_TIMEOUT_MS="5000")
    ingest = Worker("ingest", "ingest-0", env, tmp_path / "ingest.log").start()
    log = tmp_path / "reward.log"

    def reward(extra: dict[str, str]) -> subprocess.Popen[bytes]:
        w = Worker("reward", "reward-0", {**env, **extra}, log,
                   args=["--spec", str(AGENT_SPEC), "--max-batch", "30"])
        return w.start().proc  # type: ignore[return-value]

    rng = random.Random(41)
    with EventProducer(s, KEY_ID, SECRET) as events:
        harness = Harness(client, events, random.Random(1041))
        sessions = [f"agent-{i}-{uuid.uuid4().hex[:6]}" for i in range(14)]
        driver = threading.Thread(target=harness.run, args=(sessions,), daemon=True)
        try:
            wait_up([ingest])
            driver.start()
            rounds = [
                {"RTRL_TEST_REWARD_CRASH": "sessions_after_commit:1.0"},
                {"RTRL_TEST_REWARD_CRASH": "after_commit:0.5"},
                {},  # killed from outside at a random moment
                {"RTRL_TEST_REWARD_CRASH": "sessions_mid_txn:0.5"},
            ]
            kills = kill_rounds(rounds, reward, rng)
            driver.join(120)
            assert not driver.is_alive(), "the harness did not finish its sessions"
            assert not harness.errors, harness.errors
            final = Worker("reward", "reward-0", env, log, args=["--spec", str(AGENT_SPEC)]).start()
            try:
                records = read_rewards(s, expect=len(harness.served), timeout_s=120, settle_s=3)
                reconciled = subprocess.run(
                    [RTRL, "reconcile", "--strict", "--spec", str(AGENT_SPEC), "--time-scale", SCALE],
                    env=env, capture_output=True, text=True, timeout=120)
            finally:
                assert final.stop() == 0, "SIGTERM must finish both stages' batches and exit 0"
        finally:
            kill_alive([ingest])
    assert kills >= 2, f"only {kills} of {len(rounds)} reward workers died by SIGKILL; see {log}"
    counts = collections.Counter(r["request_id"] for r in records)
    assert not {k: v for k, v in counts.items() if v > 1}, "duplicated rewards"
    assert set(counts) == set(harness.served), f"missing: {sorted(set(harness.served) - set(counts))[:10]}"
    by_session: dict[str, set[float]] = collections.defaultdict(set)
    for r in records:
        rid, sid = r["request_id"], harness.served[r["request_id"]]
        assert set(r["components"]) == set(COMPONENTS), rid  # a session's credit, not a per-request one
        charged = -0.25 * harness.invalid.get(rid, 0)
        assert r["components"]["invalid_tool_calls"] == pytest.approx(charged), rid
        expected_outcome = {"completed": 1.0, "abandoned": -0.5}.get(harness.ended.get(sid, ""), 0.0)
        assert r["components"]["outcome"] == pytest.approx(expected_outcome), rid
        by_session[sid].add(round(r["reward"] - r["components"]["invalid_tool_calls"], 9))
    assert all(len(shares) == 1 for shares in by_session.values()), "a session's turns share one return"
    assert reconciled.returncode == 0, reconciled.stdout + reconciled.stderr
