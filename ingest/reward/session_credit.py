"""Session credit: one reward per served turn of a closed session (docs/rewards.md, "Sessions").

``credit(session, facts, spec)`` takes a session assembled by ``ingest/reward/sessions.py``, the
facts of its turns' requests (what the per-request join knows, by request id) and the spec's
``[session]`` terms, and returns one :class:`TurnCredit` per served turn:

    return    = outcome + persisted_edits + dissatisfied + turns + tokens
    credit(t) = return + invalid_tool_calls(t)

    outcome             the spec's value for the status: completed, handed_back, abandoned, timed_out
    persisted_edits     weight * mean of the served turns' reported edit persistence (0 if none)
    dissatisfied        -penalty * min(follow-ups to the served turns, max_count)
    turns               -per_turn * served turns
    tokens              -per_1k_tokens * (prompt + completion tokens of the served turns) / 1000
    invalid_tool_calls  -min(max per turn, per call * the turn's own tool calls with invalid arguments)

Every served turn carries the whole return, not a share of it. Summed over a session's turns,
the policy gradient is then the return times the sum of the turns' log-probability gradients
(REINFORCE over the trajectory), with no division by the number of turns: no length
normalisation, as in the objective. Divided, the turn cost would be one constant for every turn,
which group-relative advantages remove. Only invalid tool calls are charged to their own turn.

Which turns and events count:
- A *served turn* is a turn placed in the session whose request has facts (its served event was
  joined). A turn without facts is neither credited nor counted. Self-summary turns are ordinary.
- Set-aside events never credit anything: only placed turns and the tool calls placed in them
  are read. Flagged anomalies change nothing: flagged turns and calls count as placed.
- An open session is not credited (``ValueError``): credit is given once, when it closes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ingest.reward.maths import Feedback, persistence_ratio
from ingest.reward.sessions import Session, Turn
from ingest.reward.spec import SessionSpec

RETURN_COMPONENTS = ("outcome", "persisted_edits", "dissatisfied", "turns", "tokens")
COMPONENTS = (*RETURN_COMPONENTS, "invalid_tool_calls")


@dataclass(frozen=True)
class TurnFacts:
    """What the per-request join knows about one turn's request."""

    prompt_tokens: int
    completion_tokens: int
    dissatisfied: int = 0
    """Dissatisfied follow-ups to the request."""
    edit_persisted: float | None = None
    """retained/inserted of the turn's edit at the primary horizon, 0 for a rejected edit,
    None without an edit or a report (:func:`edit_persisted`)."""


@dataclass(frozen=True)
class TurnCredit:
    turn: int
    request_id: str
    reward: float
    components: dict[str, float]
    """Every key of ``COMPONENTS``; they sum to ``reward``."""


def edit_persisted(feedback: Feedback, kind: str, primary_horizon_s: int) -> float | None:
    """A turn's edit persistence as the session term reads it: the per-request persistence
    ratio of an edit not rejected, 0.0 for a rejected edit, None when there is no edit or no
    report."""
    if kind != "edit":
        return None
    if feedback.accepted is False:
        return 0.0
    return persistence_ratio(feedback.persistence, primary_horizon_s)


def served_turns(session: Session, facts: Mapping[str, TurnFacts]) -> list[Turn]:
    """The session's placed turns whose request has facts, by index."""
    return [t for t in session.turns if t.request_id in facts]


def invalid_calls(turn: Turn) -> int:
    """The turn's own tool calls with invalid arguments (placed calls only)."""
    return sum(1 for c in turn.tool_calls if not c.arguments_valid)


def outcome_value(session: Session, spec: SessionSpec) -> float:
    if session.status == "open":
        raise ValueError("an open session is not credited: credit is given once, when it closes")
    return float(getattr(spec, session.status))


def session_return(session: Session, facts: Mapping[str, TurnFacts], spec: SessionSpec) -> dict[str, float]:
    """The return's components (``RETURN_COMPONENTS``), over the served turns."""
    turns = served_turns(session, facts)
    mine = [facts[t.request_id] for t in turns]
    reported = [f.edit_persisted for f in mine if f.edit_persisted is not None]
    tokens = sum(f.prompt_tokens + f.completion_tokens for f in mine)
    comps = {
        "outcome": outcome_value(session, spec),
        "persisted_edits": spec.persisted_edits * sum(reported) / len(reported) if reported else 0.0,
        "dissatisfied": -spec.dissatisfied * min(sum(f.dissatisfied for f in mine),
                                                 spec.dissatisfied_max_count),
        "turns": -spec.per_turn * len(turns),
        "tokens": -spec.per_1k_tokens * tokens / 1000,
    }
    return {k: v + 0.0 for k, v in comps.items()}  # no -0.0 in records


def turn_penalty(turn: Turn, spec: SessionSpec) -> float:
    return -min(spec.invalid_max_per_turn, spec.invalid_tool_call * invalid_calls(turn)) + 0.0


def credit(session: Session, facts: Mapping[str, TurnFacts], spec: SessionSpec) -> tuple[TurnCredit, ...]:
    """One credit per served turn, by turn index (see the module doc for the rule)."""
    shared = session_return(session, facts, spec)
    ret = sum(shared.values())
    out = []
    for t in served_turns(session, facts):
        own = turn_penalty(t, spec)
        out.append(TurnCredit(t.index, t.request_id, ret + own, {**shared, "invalid_tool_calls": own}))
    return tuple(out)
