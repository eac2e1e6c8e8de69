"""Reward maths: pure functions from one request's joined feedback to its reward.

``compute_reward(feedback, served, spec)`` returns the reward and its named components:

    persistence        weight * retained/inserted at the primary horizon (accepted edits)
    acceptance         +accepted / rejected value (edits only)
    dissatisfied       -penalty * min(count, max_count)
    latency            -weight * min(cap, max(0, latency - slo) / slo)
    invalid_tool_calls -min(max_penalty, invalid_penalty * invalid calls)
    no_edit            -question for a clarifying question, -empty for an empty completion
    default            the spec's default reward, only when no feedback came at all

A clarifying question or an empty completion proposes no edit, so it has no persistence
or acceptance terms: any accept/reject/persistence event for it is ignored. Latency,
invalid tool calls and the no-edit penalty come from the served event itself and always apply.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

from ingest.contracts.metrics import persistence_at
from ingest.reward.spec import RewardSpec

COMPONENTS = ("persistence", "acceptance", "dissatisfied", "latency", "invalid_tool_calls", "no_edit",
              "default")


class Served(Protocol):
    """The parts of a completion.served event the reward needs."""

    @property
    def completion_kind(self) -> Literal["edit", "question", "empty", "tool_call"]: ...
    @property
    def latency_ms(self) -> float: ...
    @property
    def invalid_tool_calls(self) -> int: ...


@dataclass(frozen=True)
class Feedback:
    """What the users' clients said about one request."""

    accepted: bool | None = None
    """True accepted, False rejected, None no accept/reject event."""
    persistence: Mapping[int, tuple[int, int]] = field(default_factory=dict)
    """horizon_s -> (retained_chars, inserted_chars)."""
    dissatisfied: int = 0


def persistence_ratio(persistence: Mapping[int, tuple[int, int]], primary_s: int) -> float | None:
    """retained/inserted at the primary horizon, else at the observed horizon nearest to it
    (the shorter one on a tie); None when no usable horizon was observed."""
    usable = {h: r / i for h, (r, i) in persistence.items() if i > 0}
    return persistence_at(usable, primary_s)


def latency_penalty(latency_ms: float, slo_ms: float, weight: float, cap: float) -> float:
    over = max(0.0, latency_ms - slo_ms) / slo_ms
    return -weight * min(cap, over)


def tool_call_penalty(invalid: int, per_call: float, max_penalty: float) -> float:
    return -min(max_penalty, per_call * invalid)


def no_edit_penalty(kind: str, question: float, empty: float) -> float:
    """The product penalty for proposing no edit: ``-question`` for a clarifying question,
    ``-empty`` for an empty completion, 0 for an edit."""
    return -question if kind == "question" else -empty if kind == "empty" else 0.0


def dissatisfied_penalty(count: int, penalty: float, max_count: int) -> float:
    return -penalty * min(count, max_count)


def has_feedback(feedback: Feedback, kind: str) -> bool:
    """Whether any feedback that counts for this kind of completion arrived."""
    if feedback.dissatisfied > 0:
        return True
    return kind == "edit" and (feedback.accepted is not None or bool(feedback.persistence))


def compute_reward(
    feedback: Feedback, served: Served, spec: RewardSpec
) -> tuple[float, dict[str, float]]:
    """The reward of one served completion and its components (all keys always present)."""
    comps = dict.fromkeys(COMPONENTS, 0.0)
    kind = served.completion_kind
    comps["latency"] = latency_penalty(
        served.latency_ms, spec.latency.slo_ms, spec.latency.weight, spec.latency.cap
    )
    comps["invalid_tool_calls"] = tool_call_penalty(
        served.invalid_tool_calls, spec.tool_calls.invalid_penalty, spec.tool_calls.max_penalty
    )
    comps["no_edit"] = no_edit_penalty(kind, spec.no_edit.question, spec.no_edit.empty)
    if not has_feedback(feedback, kind):
        comps["default"] = spec.window.default_reward
    else:
        comps["dissatisfied"] = dissatisfied_penalty(
            feedback.dissatisfied, spec.dissatisfied.penalty, spec.dissatisfied.max_count
        )
        if kind == "edit":
            if feedback.accepted is True:
                comps["acceptance"] = spec.acceptance.accepted
            elif feedback.accepted is False:
                comps["acceptance"] = spec.acceptance.rejected
            if feedback.accepted is not False:
                ratio = persistence_ratio(feedback.persistence, spec.persistence.primary_horizon_s)
                if ratio is not None:
                    comps["persistence"] = spec.persistence.weight * ratio
    comps = {k: v + 0.0 for k, v in comps.items()}  # no -0.0 in records
    return sum(comps.values()), comps
