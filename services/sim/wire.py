"""What a simulated user sends to the gateway and reads from its answer, and the client events
of its reaction (pure: no clients, no clocks)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from pydantic import BaseModel

from ingest.events import EditAccepted, EditPersistence, EditRejected, FollowupDissatisfied
from services.settings.demo import SimulatorSettings
from services.sim.chat_world import ChatVocab
from services.sim.transport import CHAT, COMPLETIONS
from services.sim.users import Outcome
from trainer.tokens import EOS


def _eid() -> str:
    return uuid.uuid4().hex


def plan_events(
    outcome: Outcome, request_id: str, served_at: datetime, sim: SimulatorSettings,
) -> list[tuple[datetime, BaseModel]]:
    """The client events for one reaction, each with the wall time it is due.

    Horizons in ``outcome.retained`` are the reward spec's (nominal) seconds; every delay is
    multiplied by ``sim.time_scale``. The event's ``ts`` is its due time.
    """
    scale = sim.time_scale
    react_at = served_at + timedelta(seconds=sim.accept_delay_s * scale)
    out: list[tuple[datetime, BaseModel]] = []
    if outcome.accepted is True:
        out.append((react_at, EditAccepted(
            event_id=_eid(), request_id=request_id, ts=react_at, inserted_chars=outcome.inserted_chars)))
        for horizon, kept in sorted(outcome.retained.items()):
            at = react_at + timedelta(seconds=horizon * scale)
            out.append((at, EditPersistence(
                event_id=_eid(), request_id=request_id, ts=at, horizon_s=horizon,
                retained_chars=kept, inserted_chars=outcome.inserted_chars)))
    elif outcome.accepted is False:
        out.append((react_at, EditRejected(
            event_id=_eid(), request_id=request_id, ts=react_at, inserted_chars=outcome.inserted_chars)))
    if outcome.dissatisfied:
        at = react_at + timedelta(seconds=sim.followup_delay_s * scale)
        out.append((at, FollowupDissatisfied(
            event_id=_eid(), request_id=request_id, ts=at, reason=f"simulated:{outcome.kind}")))
    return out


@dataclass(frozen=True)
class Answer:
    """What a simulated user takes from the gateway's answer."""

    request_id: str
    arm: str
    version: str
    tokens: list[int]
    """The completion in the world's ids (as read, for a chat answer)."""
    latency_ms: float


def token_request(prompt: list[int], user_key: str, session: str, request_id: str,
                  sim: SimulatorSettings) -> tuple[str, dict[str, Any]]:
    """The token-id API's request (GATEWAY_API.md)."""
    return COMPLETIONS, {"user_key": user_key, "session_id": session, "prompt_tokens": prompt,
                         "max_tokens": sim.max_tokens, "request_id": request_id,
                         "temperature": sim.temperature}


def chat_request(prompt: list[int], user_key: str, request_id: str, sim: SimulatorSettings,
                 vocab: ChatVocab) -> tuple[str, dict[str, Any]]:
    """An OpenAI chat request: the prompt's words as the user's message; rtrl's request id as
    the extension field the official client sends with ``extra_body``. No session is named:
    these users ask one thing at a time, and a named session would make every ask an agent
    session's turn (docs/gateway.md, "Sessions")."""
    return CHAT, {"messages": [{"role": "user", "content": vocab.message(prompt)}], "user": user_key,
                  "request_id": request_id, "max_tokens": sim.max_tokens, "temperature": sim.temperature}


def agent_chat_request(prompt: list[int], user_key: str, session: str, turn: int, request_id: str,
                       sim: SimulatorSettings, vocab: ChatVocab) -> tuple[str, dict[str, Any]]:
    """An agent session's turn as an OpenAI chat request: the turn's prompt as the user's
    message, the session named and the turn index given (the gateway logs the turn's
    ``session.turn``, docs/gateway.md, "Sessions")."""
    path, body = chat_request(prompt, user_key, request_id, sim, vocab)
    return path, {**body, "session_id": session, "turn": turn}


def token_answer(resp: dict[str, Any], request_id: str) -> Answer:
    return Answer(str(resp.get("request_id", request_id)), str(resp.get("arm", "stable")),
                  str(resp.get("model", {}).get("version", "?")), list(resp["completion_tokens"]),
                  float(resp["latency_ms"]))


def chat_answer(resp: dict[str, Any], request_id: str, vocab: ChatVocab) -> Answer:
    """A chat answer as the user reads it (:meth:`ChatVocab.read`); the arm, version and the
    latency the gateway logged come from its ``rtrl`` extension."""
    ext = resp.get("rtrl") or {}
    text = (resp["choices"][0].get("message") or {}).get("content") or ""
    return Answer(str(ext.get("request_id", request_id)), str(ext.get("arm", "stable")),
                  str(ext.get("version", "?")), vocab.read(text), float(ext["latency_ms"]))


def agent_chat_answer(resp: dict[str, Any], request_id: str, vocab: ChatVocab) -> Answer:
    """A chat answer as an agent's harness reads it: :func:`chat_answer`'s words, then EOS
    when the model ended its answer itself (``finish_reason`` ``stop``), so an answer cut off
    at ``max_tokens`` reads as a call cut short (services/sim/agent.py)."""
    answer = chat_answer(resp, request_id, vocab)
    return replace(answer, tokens=as_ended(answer.tokens, resp["choices"][0].get("finish_reason") == "stop"))


def as_ended(words: list[int], stopped: bool) -> list[int]:
    """An agent's answer as its harness reads it: the words, then EOS when the model ended the
    answer itself (``stopped``), so an answer cut off at ``max_tokens`` reads as cut short."""
    return [*words, EOS] if stopped else words
