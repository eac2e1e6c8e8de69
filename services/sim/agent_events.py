"""The events an agent's harness sends for one turn of a simulated session (pure).

The turn itself is served by rtrl's gateway as an OpenAI completion with token ids that names
its session and turn, so the gateway logs its ``completion.served`` and ``session.turn``. The
completions API knows no tools: the harness reads the tool call out of the answer
(services/sim/agent.py) and is the one that sends, as a client of ingest:

    tool.call          at the answer (dispatched when its arguments are valid, else blocked)
    tool.result        accept_delay_s after a dispatched call (the tool ran)
    edit.*             for an answer: accept/reject and persistence, as a one-shot user's
    followup.dissatisfied  followup_delay_s after an annoying question or answer
    session.end        accept_delay_s after the session's last turn

Every delay is multiplied by ``simulator.time_scale``; an event's ``ts`` is when it is due.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta

from pydantic import BaseModel

from ingest.events import FollowupDissatisfied, SessionEnd, ToolCall, ToolResult
from services.settings.demo import SimulatorSettings
from services.sim.agent import AgentWorld, Step
from services.sim.wire import plan_events

RESULT_TOKENS = 12
"""Tokens of a tool result as the model reads it back (the simulated tools answer briefly)."""


def _eid() -> str:
    return uuid.uuid4().hex


def turn_events(aw: AgentWorld, session_id: str, turn: int, request_id: str, step: Step,
                served_at: datetime, sim: SimulatorSettings) -> list[tuple[datetime, BaseModel]]:
    """The harness's events for turn ``turn`` (request ``request_id``) of ``session_id``."""
    scale = sim.time_scale
    react_at = served_at + timedelta(seconds=sim.accept_delay_s * scale)
    base = {"session_id": session_id, "turn": turn, "request_id": request_id}
    out: list[tuple[datetime, BaseModel]] = []
    action = step.action
    if action.kind == "call":
        call_id = f"call-{turn}-{uuid.uuid4().hex[:12]}"
        out.append((served_at, ToolCall(
            event_id=_eid(), ts=served_at, **base, call_id=call_id, tool=action.tool,
            arguments_valid=action.valid, invalid_reason=action.invalid_reason,
            arguments_chars=sum(aw.world.chars[t] for t in action.args),
            outcome="dispatched" if action.valid else "blocked")))
        if step.result is not None:
            out.append((react_at, ToolResult(event_id=_eid(), ts=react_at, **base, call_id=call_id,
                                             status=step.result, result_tokens=RESULT_TOKENS)))
    if step.outcome is not None:
        out.extend(plan_events(step.outcome, request_id, served_at, sim))
    if step.dissatisfied:
        at = react_at + timedelta(seconds=sim.followup_delay_s * scale)
        out.append((at, FollowupDissatisfied(event_id=_eid(), request_id=request_id, ts=at,
                                             reason=f"simulated:{action.kind}")))
    if step.end is not None:
        out.append((react_at, SessionEnd(event_id=_eid(), ts=react_at, **base, outcome=step.end)))
    return out
