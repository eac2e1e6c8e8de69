"""Agent sessions end to end, as a team would run them: an agent harness on the official
``openai`` client drives multi-turn tool-calling sessions through the gateway (naming its
session, sending each call's result back in the history), and sends what only it knows
(``tool.result``, ``session.end``, a rejected edit) to ingest. A real ingest worker and
reward worker processes with the agent spec run against the broker and Redis; the reward
workers are SIGKILLed at both stages' commit points and at random moments while the
sessions run. In the end every served turn has exactly one reward record carrying its
session's credit, and ``rtrl reconcile --strict`` finds nothing lost, duplicated or
unreflected.

Two engines behind the gateway (its upstream mode, as a team runs its own inference
servers): bench/fake_engine.py, whose tool calls carry the last user message as arguments
(the harness decides which are valid), and a real vLLM serving the tiny test model with
its ``hermes`` tool parser, whose calls are whatever the model writes (most are invalid).
Either way the harness judges each call it got on its own (JSON, then the tool's schema)
and expects the reward to charge exactly the invalid ones."""

from __future__ import annotations

import collections
import json
import random
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from pydantic import SecretStr
from reward_helpers import kill_rounds, read_rewards
from session_helpers import AGENT_SPEC

from bench.fake_engine import FakeEngine
from ingest.events import EditRejected, SessionEnd, ToolResult
from ingest.reward.session_credit import COMPONENTS
from services.runtime.event_producer import EventProducer
from services.runtime.kafka_io import ensure_topics
from services.settings.model import AuthSettings, Settings
from services.settings.services import GatewaySettings, IngestSettings, RewardSettings, UpstreamSettings
from tests.gateway_inproc import openai_gateway
from tests.integration.conftest import Engine
from tests.reliability.workload import KEY_ID, RTRL, SECRET, Worker, env_for, kill_alive, wait_up

pytestmark = [pytest.mark.integration, pytest.mark.reliability, pytest.mark.timeout(420)]

API_KEY = "sk-agent-e2e"
SCALE = "0.02"
"""The reward workers' time scale: a tool-call turn closes 1.2 s after it was seen, a rejected
edit at once, an idle session 36 s after its last event. A killed worker's replacement can
take 15 s to start on a loaded machine, and a session's deadlines run on the wall clock
across that gap (docs/rewards.md), so the idle window must outlast it: at 0.005 (9 s) a
session still running closed as timed out."""
SCHEMA: Any = {"type": "object", "properties": {"path": {"type": "string", "maxLength": 8}},
          "required": ["path"], "additionalProperties": False}
READ: Any = {"type": "function", "function": {"name": "read_file", "parameters": SCHEMA}}
NAMED: Any = {"type": "function", "function": {"name": "read_file"}}


def invalid(name: str, arguments: str) -> bool:
    """The harness's own verdict on a call it got: read_file with a JSON object (no NaN or
    Infinity) that satisfies the schema."""
    if name != "read_file":
        return True
    try:
        value = json.loads(arguments, parse_constant=_refuse)
    except ValueError:
        return True
    return not isinstance(value, dict) or not jsonschema.Draft202012Validator(SCHEMA).is_valid(value)


def _refuse(name: str) -> Any:
    raise ValueError(name)


class Harness:
    """An agent's harness: runs sessions through the gateway with the openai client and sends
    the events only it can see, signed, to the raw topic."""

    def __init__(self, client: openai.OpenAI, model: str, events: EventProducer, rng: random.Random,
                 named: bool = False, max_tokens: int = 16) -> None:
        self.client, self.model, self.events, self.rng = client, model, events, rng
        self.named, self.max_tokens = named, max_tokens
        """``named``: ask for read_file by name (vLLM serves calls so); else offer it (auto)."""
        self.served: dict[str, str] = {}  # request id -> session id
        self.ended: dict[str, str] = {}  # session id -> outcome
        self.invalid: dict[str, int] = {}  # request id -> invalid calls made
        self.calls = 0
        self.errors: list[BaseException] = []

    def session(self, sid: str) -> None:
        rng, history = self.rng, []
        turns = rng.randint(1, 4)
        text_last = rng.random() < 0.4
        for t in range(turns):
            rid = f"{sid}-r{t}"
            calling = not (text_last and t == turns - 1)
            valid = rng.random() > 0.3
            history.append({"role": "user", "content": '{"path": "app.py"}' if valid else "open app.py"})
            kw: dict[str, Any] = {"tools": [READ]} if calling else {}
            if calling and self.named:
                kw["tool_choice"] = NAMED
            answer: Any = self.client.chat.completions.create(
                model=self.model, user=f"dev-{sid}", messages=history, stream=rng.random() < 0.3,
                max_tokens=self.max_tokens, extra_body={"session_id": sid, "request_id": rid}, **kw)
            text, calls = _answer(answer)
            self.served[rid] = sid
            self.calls += len(calls)
            if not calls:  # a text answer (the fake engine's without tools; a vLLM call cut short)
                history.append({"role": "assistant", "content": text})
                # the user rejects the proposed edit: its window closes now (not after 72 s)
                self.send(EditRejected(event_id=uuid.uuid4().hex, request_id=rid, ts=_now()))
                continue
            self.invalid[rid] = sum(invalid(name, arguments) for _id, name, arguments in calls)
            history.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in calls]})
            for call_id, name, arguments in calls:
                bad = invalid(name, arguments)
                history.append({"role": "tool", "tool_call_id": call_id, "content": "error" if bad else "ok"})
                self.send(ToolResult(event_id=uuid.uuid4().hex, request_id=rid, ts=_now(), session_id=sid,
                                     turn=t, call_id=call_id, status="error" if bad else "ok",
                                     result_tokens=1))
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


def _answer(answer: Any) -> tuple[str, list[tuple[str, str, str]]]:
    """The text and the (id, name, arguments) calls of a whole or streamed answer."""
    if hasattr(answer, "choices"):
        message = answer.choices[0].message
        return message.content or "", [(c.id, c.function.name, c.function.arguments)
                                       for c in message.tool_calls or []]
    text, calls = "", {}
    for chunk in answer:  # streamed: a call's id and name come first, its arguments in pieces
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        text += delta.content or ""
        for piece in delta.tool_calls or []:
            call = calls.setdefault(piece.index, ["", "", ""])
            fn = piece.function
            call[0] = piece.id or call[0]
            call[1] = (fn.name if fn and fn.name else "") or call[1]
            call[2] += (fn.arguments or "") if fn else ""
    return text, [tuple(calls[i]) for i in sorted(calls)]  # type: ignore[misc]


def _now() -> datetime:
    return datetime.now(UTC)


@contextmanager
def gateway(settings: Settings, base_url: str, model: str) -> Iterator[tuple[openai.OpenAI, Settings]]:
    """The gateway in this process in front of the engine at ``base_url``, signing its events
    with the key the harness's ingest trusts."""
    cfg = settings.model_copy(update={
        "auth": AuthSettings(keys={KEY_ID: SecretStr(SECRET)}),
        "ingest": IngestSettings(group_id=f"ingest-{settings.topics.raw}"),
        "reward": RewardSettings(group_id=f"reward-{settings.topics.raw}", time_scale=float(SCALE)),
        "gateway": GatewaySettings(**{
            "port": 0, "key_id": KEY_ID, "api_keys": {"team": SecretStr(API_KEY)},
            "stable_upstream": UpstreamSettings(base_url=base_url, model=model)})})
    ensure_topics(cfg)
    with openai_gateway(cfg, API_KEY, timeout_s=60) as client:
        yield client, cfg


def test_sessions_on_the_fake_engine_get_one_reward_per_turn_across_reward_sigkills(
        isolated_settings: Settings, tmp_path: Path) -> None:
    engine = FakeEngine(token_ms=1.0).start()
    try:
        with gateway(isolated_settings, engine.url, "team-model") as (client, s):
            harness = Harness(client, "team-model", EventProducer(s, KEY_ID, SECRET), random.Random(1041))
            check_sessions(s, harness, n=14, tmp=tmp_path)
    finally:
        engine.stop()
    assert sum(harness.invalid.values()) > 0 and len(harness.invalid) > sum(harness.invalid.values())


def test_sessions_on_a_real_vllm_get_one_reward_per_turn_across_reward_sigkills(
        isolated_settings: Settings, vllm_engine: Engine, tmp_path: Path) -> None:
    with gateway(isolated_settings, vllm_engine.base_url, vllm_engine.model) as (client, s):
        harness = Harness(client, vllm_engine.model, EventProducer(s, KEY_ID, SECRET), random.Random(2077),
                          named=True, max_tokens=80)
        check_sessions(s, harness, n=8, tmp=tmp_path)
    assert harness.calls > 0, "the engine made no tool call at all"


def check_sessions(s: Settings, harness: Harness, n: int, tmp: Path) -> None:
    """Run ``n`` sessions through ``harness`` while reward workers are SIGKILLed, then check
    one record per served turn with its session's credit, and reconcile."""
    env = env_for(s, tmp, RTRL_REWARD__TIME_SCALE=SCALE, RTRL_REWARD__TRANSACTION_TIMEOUT_MS="5000")
    ingest = Worker("ingest", "ingest-0", env, tmp / "ingest.log").start()
    log = tmp / "reward.log"

    def reward(extra: dict[str, str]) -> subprocess.Popen[bytes]:
        w = Worker("reward", "reward-0", {**env, **extra}, log,
                   args=["--spec", str(AGENT_SPEC), "--max-batch", "30"])
        return w.start().proc  # type: ignore[return-value]

    rounds = [
        {"RTRL_TEST_REWARD_CRASH": "sessions_after_commit:1.0"},
        {"RTRL_TEST_REWARD_CRASH": "after_commit:0.5"},
        {},  # killed from outside at a random moment
        {"RTRL_TEST_REWARD_CRASH": "sessions_mid_txn:0.5"},
    ]
    sessions = [f"agent-{i}-{uuid.uuid4().hex[:6]}" for i in range(n)]
    driver = threading.Thread(target=harness.run, args=(sessions,), daemon=True)
    try:
        wait_up([ingest])
        driver.start()
        kills = kill_rounds(rounds, reward, random.Random(41))
        driver.join(180)
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
        harness.events.close()
    assert kills >= 2, f"only {kills} of {len(rounds)} reward workers died by SIGKILL; see {log}"
    counts = collections.Counter(r["request_id"] for r in records)
    assert not {k: v for k, v in counts.items() if v > 1}, "duplicated rewards"
    assert set(counts) == set(harness.served), f"missing: {sorted(set(harness.served) - set(counts))[:10]}"
    by_session: dict[str, set[float]] = collections.defaultdict(set)
    for r in records:
        rid, sid = r["request_id"], harness.served[r["request_id"]]
        assert set(r["components"]) == set(COMPONENTS), rid  # a session's credit, not a per-request one
        charged = -min(0.25 * harness.invalid.get(rid, 0), 1.0)
        assert r["components"]["invalid_tool_calls"] == pytest.approx(charged), rid
        expected_outcome = {"completed": 1.0, "abandoned": -0.5}.get(harness.ended.get(sid, ""), 0.0)
        assert r["components"]["outcome"] == pytest.approx(expected_outcome), rid
        by_session[sid].add(round(r["reward"] - r["components"]["invalid_tool_calls"], 9))
        about = r["session_credit"]  # what the judge's per-session metrics read
        turns = sorted(k for k, v in harness.served.items() if v == sid)
        assert (about["turn"], about["turns"]) == (turns.index(rid), len(turns)), rid
        assert about["lead"] == (rid == turns[0]), rid
        assert about["status"] == harness.ended.get(sid, "timed_out"), rid
        assert about["invalid_tool_calls"] == sum(harness.invalid.get(t, 0) for t in turns), rid
    assert all(len(shares) == 1 for shares in by_session.values()), "a session's turns share one return"
    assert reconciled.returncode == 0, reconciled.stdout + reconciled.stderr
    print(f"{len(harness.served)} turns in {n} sessions ({len(harness.ended)} ended), "
          f"{harness.calls} tool calls, {sum(harness.invalid.values())} invalid; "
          f"{kills} reward workers SIGKILLed")
