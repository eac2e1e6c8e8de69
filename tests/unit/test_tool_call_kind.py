"""``completion_kind: tool_call``, an additive value of the v1 contract: valid in events and
the exported schema, earlier events unchanged, rewarded and judged as a turn that proposes no
edit (hand-computed expectations)."""

from __future__ import annotations

import json

import pytest

from ingest.events import CompletionServed, parse_event
from ingest.reward.join import early_close
from ingest.reward.maths import Feedback, compute_reward
from ingest.reward.spec import default_spec_text, parse_spec
from rollback.columns import columns_from, metric_values
from rollback.types import RequestOutcome
from services.cli.events import render_schema, validate_lines
from tests.unit.test_events_contract import served

pytestmark = pytest.mark.unit

SPEC = parse_spec(default_spec_text().replace("question = 0.0\nempty = 0.0", "question = 0.5\nempty = 0.5"))
"""The default spec (0.25 per invalid call, at most 1) with the demo's no-edit penalty of 0.5."""


def test_tool_call_is_a_valid_kind_and_earlier_events_stay_valid() -> None:
    event = parse_event(json.dumps(served(completion_kind="tool_call", tool_calls=2, invalid_tool_calls=1)))
    assert isinstance(event, CompletionServed) and event.completion_kind == "tool_call"
    lines = [json.dumps(served(event_id=f"e{i}", **kind)).encode() for i, kind in enumerate(
        [{}, {"completion_kind": "edit"}, {"completion_kind": "question"}, {"completion_kind": "empty"},
         {"completion_kind": "tool_call"}])]
    assert validate_lines(lines) == (5, [])
    ok, bad = validate_lines([json.dumps(served(completion_kind="tools")).encode()])
    assert ok == 0 and "completion_kind" in bad[0][1]
    schema = json.loads(render_schema())
    kinds = schema["$defs"]["CompletionServed"]["properties"]["completion_kind"]["enum"]
    assert kinds == ["edit", "question", "empty", "tool_call"]


def test_a_tool_call_turn_has_no_edit_terms_and_no_no_edit_penalty() -> None:
    event = parse_event(json.dumps(served(completion_kind="tool_call", tool_calls=3, invalid_tool_calls=2,
                                          latency_ms=10.0)))
    assert isinstance(event, CompletionServed)
    reward, parts = compute_reward(Feedback(accepted=True, persistence={600: (10, 10)}), event, SPEC)
    assert SPEC.no_edit.question == 0.5 and SPEC.tool_calls.invalid_penalty == 0.25
    assert parts["invalid_tool_calls"] == -0.5 and parts["no_edit"] == 0.0
    assert parts["acceptance"] == 0.0 and parts["persistence"] == 0.0
    assert parts["default"] == SPEC.window.default_reward  # edit feedback does not count for it
    assert reward == pytest.approx(-0.5 + SPEC.window.default_reward)


def test_a_tool_call_turn_closes_after_the_follow_up_wait() -> None:
    assert early_close("tool_call", 100.0, None, None, followup=30.0) == 130.0
    assert early_close("edit", 100.0, None, None, followup=30.0) is None


def test_tool_call_turns_are_neither_edits_nor_questions_for_the_judge() -> None:
    outcomes = [RequestOutcome(user_key="u", reward=0.0, latency_ms=1.0, completion_kind=kind)
                for kind in ("edit", "question", "tool_call", "tool_call")]
    cols = columns_from(outcomes)
    assert list(metric_values(cols, "edit_rate")[0]) == [1.0, 0.0, 0.0, 0.0]
    assert list(metric_values(cols, "question_rate")[0]) == [0.0, 1.0, 0.0, 0.0]
