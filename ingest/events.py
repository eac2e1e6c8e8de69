"""Event contract v1: what clients and the serving layer send, and what the reward join emits.

Every event carries ``schema_version``, a unique ``event_id``, its ``type``, the
``request_id`` it belongs to and the producer's UTC timestamp ``ts``. The Kafka key is the
``request_id``, so all events of one request land on one partition.

Sessions (contract revision 1.1, additive): an agent turn is a served request inside a
``session_id``. Five more types describe a session, each naming its session, the turn index
and the turn's ``request_id`` (still the Kafka key): ``session.turn``, ``tool.call``,
``tool.result``, ``session.summary`` and ``session.end``. Each is checked on its own here
and by ingest; checks across a session's events live in ``ingest/reward/sessions.py``.

The JSON Schema exported from these models lives at ``ingest/schema/events.v1.json``;
regenerate it with ``rtrl events schema --write`` after changing a model.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Literal

from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    field_validator,
    model_validator,
)

SCHEMA_VERSION = 1

Id = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:\-]+$")]
TokenId = Annotated[int, Field(ge=0, lt=2**31)]
INT64_MAX = 2**63 - 1
Count = Annotated[int, Field(ge=0, le=INT64_MAX)]
"""A non-negative count that a consumer reading 64-bit integers can hold."""
Arm = Literal["stable", "canary", "holdout"]
LogProb = Annotated[float, Field(le=0.0, allow_inf_nan=False)]
CompletionKind = Literal["edit", "question", "empty", "tool_call"]
"""What a completion was: a proposed edit, a clarifying question, nothing (or a refusal),
or tool calls (``tool_call``, an additive value: events without it stay valid). The gateway's
rule for chat answers is in docs/gateway.md."""


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelRef(_Model):
    """The exact policy that served a completion."""

    name: Annotated[str, Field(min_length=1, max_length=200)]
    version: Annotated[str, Field(min_length=1, max_length=64)]


class _EventBase(_Model):
    schema_version: Literal[1] = 1
    event_id: Id
    request_id: Id
    ts: AwareDatetime
    """Producer time; must carry a timezone (UTC recommended)."""

    @field_validator("ts")
    @classmethod
    def _to_utc(cls, v: datetime) -> datetime:
        try:
            return v.astimezone(UTC)
        except OverflowError:  # e.g. 0001-01-01T00:00:00+14:00 is before year 1 in UTC
            raise ValueError("ts is outside the range of UTC dates (years 1-9999)") from None

    @field_validator("schema_version", mode="before")
    @classmethod
    def _not_a_bool(cls, v: object) -> object:
        if isinstance(v, bool):  # JSON true is not version 1, though True == 1 in Python
            raise ValueError(f"schema_version must be the number {SCHEMA_VERSION}, not a boolean")
        return v


class CompletionServed(_EventBase):
    """Emitted by the serving layer (the gateway) once per completion."""

    type: Literal["completion.served"] = "completion.served"
    session_id: Id
    user_key: Id
    """Pseudonymous user key: the unit of randomisation and of analysis."""
    model: ModelRef
    arm: Arm
    prompt_tokens: Annotated[list[TokenId], Field(max_length=32_768)]
    completion_tokens: Annotated[list[TokenId], Field(max_length=32_768)]
    logprobs: Annotated[list[LogProb], Field(max_length=32_768)]
    """The serving policy's log-probability of each completion token (behavior policy)."""
    latency_ms: Annotated[float, Field(ge=0, le=3_600_000, allow_inf_nan=False)]
    tool_calls: Count = 0
    invalid_tool_calls: Count = 0
    completion_kind: CompletionKind = "edit"
    """What the completion was (:data:`CompletionKind`)."""
    temperature: Annotated[float, Field(ge=0.0, le=100.0, allow_inf_nan=False)] = 1.0
    """The sampling temperature the completion was drawn at, hence of ``logprobs`` (0:
    greedy, logged at temperature 1). Additive: an event without it was sampled at 1."""

    @model_validator(mode="after")
    def _consistent(self) -> CompletionServed:
        if len(self.logprobs) != len(self.completion_tokens):
            raise ValueError("logprobs must have one entry per completion token")
        if self.invalid_tool_calls > self.tool_calls:
            raise ValueError("invalid_tool_calls exceeds tool_calls")
        return self


class EditAccepted(_EventBase):
    type: Literal["edit.accepted"] = "edit.accepted"
    inserted_chars: Count


class EditRejected(_EventBase):
    type: Literal["edit.rejected"] = "edit.rejected"
    inserted_chars: Count = 0


class EditPersistence(_EventBase):
    """Sent by the client at a horizon after acceptance: how much of the edit is still there."""

    type: Literal["edit.persistence"] = "edit.persistence"
    horizon_s: Annotated[int, Field(gt=0, le=30 * 86_400)]
    retained_chars: Count
    inserted_chars: Count

    @model_validator(mode="after")
    def _retained_le_inserted(self) -> EditPersistence:
        if self.retained_chars > self.inserted_chars:
            raise ValueError("retained_chars exceeds inserted_chars")
        return self


class FollowupDissatisfied(_EventBase):
    """The user's follow-up to this request expressed dissatisfaction."""

    type: Literal["followup.dissatisfied"] = "followup.dissatisfied"
    reason: Annotated[str, Field(max_length=200)] | None = None


# ---------------------------------------------------------------------- sessions (revision 1.1)
CONTRACT_REVISION = "1.1"
"""Additive revisions of contract v1: 1.0 requests, 1.1 sessions. Every 1.0 event is valid
and means the same under 1.1; a change that is not additive takes ``schema_version`` 2."""
TURN_MAX = 999_999
"""The largest turn index (turns count from 0). Larger is an ``invalid_field``."""
TurnIndex = Annotated[int, Field(ge=0, le=TURN_MAX)]
ToolName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:\-]+$")]


class _SessionEventBase(_EventBase):
    """A session's event: ``request_id`` is the request served as turn ``turn``."""

    session_id: Id
    turn: TurnIndex
    """The turn's index in its session, from 0."""


class SessionTurn(_SessionEventBase):
    """Sent by the serving layer once per served turn, beside its ``completion.served``:
    the turn ``turn`` of ``session_id`` is the request ``request_id``."""

    type: Literal["session.turn"] = "session.turn"


class ToolCall(_SessionEventBase):
    """A tool call the model made in turn ``turn`` (sent by the serving layer)."""

    type: Literal["tool.call"] = "tool.call"
    call_id: Id
    """Unique within the session; the ``tool.result`` that answers the call names it."""
    tool: ToolName
    arguments_valid: bool
    """Whether the arguments are JSON that is valid against the tool's declared schema."""
    invalid_reason: Literal["unknown_tool", "not_json", "schema_mismatch"] | None = None
    """Why not, when ``arguments_valid`` is false (then required; null otherwise)."""
    arguments_chars: Count = 0
    outcome: Literal["dispatched", "blocked"]
    """``dispatched``: handed on to be run (a ``tool.result`` should follow); ``blocked``:
    never run (the serving layer or the client refused it)."""

    @model_validator(mode="after")
    def _reason_iff_invalid(self) -> ToolCall:
        if self.arguments_valid == (self.invalid_reason is not None):
            raise ValueError("invalid_reason is required when arguments_valid is false, "
                             "and must be null when it is true")
        return self


class ToolResult(_SessionEventBase):
    """A tool's result returned to the model in turn ``turn`` (the call's turn or later)."""

    type: Literal["tool.result"] = "tool.result"
    call_id: Id
    status: Literal["ok", "error", "timeout", "refused"]
    """``refused``: the user declined to run the call."""
    result_tokens: Count = 0
    """Tokens of the result as the model reads it (masked in training)."""


class SessionSummary(_SessionEventBase):
    """Turn ``turn``'s completion is a self-summary that replaces the turns
    ``replaced_from``..``replaced_to`` (inclusive, all before ``turn``) in the context."""

    type: Literal["session.summary"] = "session.summary"
    replaced_from: TurnIndex
    replaced_to: TurnIndex
    summary_tokens: Count

    @model_validator(mode="after")
    def _replaces_earlier_turns(self) -> SessionSummary:
        if not self.replaced_from <= self.replaced_to < self.turn:
            raise ValueError("the replaced turns must satisfy replaced_from <= replaced_to < turn")
        return self


class SessionEnd(_SessionEventBase):
    """The session ended after turn ``turn`` (its last), with ``request_id`` that turn's."""

    type: Literal["session.end"] = "session.end"
    outcome: Literal["completed", "abandoned", "handed_back"]
    """``completed``: the task is done; ``abandoned``: the user left it; ``handed_back``:
    the agent returned control to the user without finishing."""


SessionEvent = SessionTurn | ToolCall | ToolResult | SessionSummary | SessionEnd
SESSION_EVENT_TYPES = ("session.turn", "tool.call", "tool.result", "session.summary", "session.end")

Event = Annotated[
    CompletionServed | EditAccepted | EditRejected | EditPersistence | FollowupDissatisfied
    | SessionTurn | ToolCall | ToolResult | SessionSummary | SessionEnd,
    Field(discriminator="type"),
]
EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)
EVENT_TYPES = ("completion.served", "edit.accepted", "edit.rejected", "edit.persistence",
               "followup.dissatisfied", *SESSION_EVENT_TYPES)


SessionStatus = Literal["completed", "abandoned", "handed_back", "timed_out"]
"""How a credited session closed: its ``session.end`` outcome, or ``timed_out``."""


class CreditedSession(_Model):
    """What a reward record the session stage credited says of its session (revision 1.1,
    additive: a request outside any session has none). The judge's per-session figures
    (docs/judge.md) count each session once, at its ``lead`` record."""

    turn: TurnIndex
    """This record's turn index."""
    turns: Annotated[int, Field(ge=1, le=TURN_MAX + 1)]
    """The session's credited (served) turns."""
    status: SessionStatus
    invalid_tool_calls: Count
    """Invalid tool calls placed in the session's credited turns."""
    lead: bool
    """The session's first credited turn: the one record per session that carries it."""


class RewardRecord(_Model):
    """One closed reward for one served completion: everything training needs."""

    schema_version: Literal[1] = 1
    request_id: Id
    served_event_id: Id
    session_id: Id
    user_key: Id
    served_ts: AwareDatetime
    closed_ts: AwareDatetime
    model: ModelRef
    arm: Arm
    prompt_tokens: list[int]
    completion_tokens: list[int]
    behavior_logprobs: list[float]
    temperature: float = 1.0
    """The sampling temperature of ``behavior_logprobs`` (the served event's)."""
    latency_ms: float
    completion_kind: CompletionKind = "edit"
    tool_calls: int = 0
    invalid_tool_calls: int = 0
    accepted: bool | None = None
    """True accepted, False rejected, None no accept/reject feedback."""
    persistence: dict[str, float] = Field(default_factory=dict)
    """horizon (seconds, as a string key) -> retained/inserted ratio for horizons observed."""
    dissatisfied: int = 0
    reward: float
    components: dict[str, float]
    reward_spec_version: str
    defaulted: bool = False
    """True when no feedback came at all and the spec's default reward was used."""
    session_credit: CreditedSession | None = None
    """Set when the reward is its session's credit (a reward spec with ``[session]``)."""


def parse_event(data: bytes | str) -> Event:
    """Parse and validate one event from JSON; raises pydantic.ValidationError.

    Strict, as the JSON Schema is: a count sent as ``"3"`` or ``true``, a number as a
    string, or ``ts`` as epoch seconds is a wrong type, not something to coerce.
    """
    return EVENT_ADAPTER.validate_json(data, strict=True)


def event_json_schema() -> dict[str, object]:
    """The JSON Schema client teams validate against (committed as events.v1.json)."""
    schema = EVENT_ADAPTER.json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = "https://rtrl.dev/schema/events.v1.json"
    schema["title"] = "rtrl event v1"
    schema["description"] = f"Contract v1, revision {CONTRACT_REVISION} (1.0 requests, 1.1 sessions)."
    return schema
