"""The reward join as pure state transitions over one request's window.

A *window* collects every event of one ``request_id``. Each transition is a plain
function of (state, event, now) so it can be replayed, tested against fakes, and stored
anywhere (the reward service keeps windows in Redis so any worker can take over).

Clock: all times here are the *processing* wall clock (Unix seconds on the reward worker
when it applied the event), not the producers' ``ts``. A window opens when its first event
is seen (usually ``completion.served``; feedback may arrive first) and is due at
``opened_at + (largest horizon + grace) * time_scale``. Producer clocks never move a due
time, so a skewed client cannot close or hold a window, and ``time_scale`` compresses every
horizon for demos and tests (``time_scale=0.01`` turns one hour into 36 s).

A window closes early when nothing more is expected:
- an edit whose persistence at the largest horizon has been reported closes at once;
- a rejected edit closes ``followup_s * time_scale`` after the rejection was seen;
- a clarifying question or an empty completion closes ``followup_s * time_scale`` after the
  served event was seen (time for a dissatisfied follow-up, nothing else to wait for).

``apply`` is idempotent: every window remembers the ``event_id`` values it has applied,
so a replayed event changes nothing. Whether a request was already emitted is not part of
the window (the window is deleted once its reward is out); ``apply_batch`` takes the set
of emitted request ids and reports events for them as *late*.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from ingest.events import (
    CompletionServed,
    EditAccepted,
    EditPersistence,
    EditRejected,
    Event,
    FollowupDissatisfied,
    RewardRecord,
    SessionTurn,
)
from ingest.reward.maths import Feedback, compute_reward, has_feedback
from ingest.reward.spec import RewardSpec

MAX_CLAIMS = 8
"""Sessions a request's window remembers claiming it; later claims get no note."""


@dataclass(frozen=True)
class Window:
    """Everything known about one request until its reward is emitted."""

    request_id: str
    opened_at: float
    """Processing time the first event of this request was seen."""
    last_event_at: float
    event_ids: frozenset[str] = frozenset()
    served: CompletionServed | None = None
    served_seen_at: float | None = None
    decision: tuple[float, bool] | None = None
    """(producer ts, accepted) of the latest accept/reject event; on a tie, rejected wins."""
    decided_at: float | None = None
    """Processing time of that decision."""
    persistence: Mapping[int, tuple[float, int, int]] = field(default_factory=dict)
    """horizon_s -> (producer ts, retained, inserted); the latest report per horizon."""
    final_horizon_at: float | None = None
    """Processing time the largest horizon's persistence was first seen."""
    dissatisfied: int = 0
    feedback_events: int = 0
    sessions: tuple[str, ...] = ()
    """Sessions whose ``session.turn`` claimed this request, in the order seen (at most
    ``MAX_CLAIMS``); the first gets the request's facts (ingest/reward/session_stage.py)."""

    # ------------------------------------------------------------------ derived
    def feedback(self) -> Feedback:
        return Feedback(
            accepted=None if self.decision is None else self.decision[1],
            persistence={h: (r, i) for h, (_, r, i) in self.persistence.items()},
            dissatisfied=self.dissatisfied,
        )

    # ------------------------------------------------------------------ storage
    def to_json(self) -> str:
        return json.dumps({
            "request_id": self.request_id,
            "opened_at": self.opened_at,
            "last_event_at": self.last_event_at,
            "event_ids": sorted(self.event_ids),
            "served": None if self.served is None else self.served.model_dump(mode="json"),
            "served_seen_at": self.served_seen_at,
            "decision": self.decision,
            "decided_at": self.decided_at,
            "persistence": {str(h): list(v) for h, v in self.persistence.items()},
            "final_horizon_at": self.final_horizon_at,
            "dissatisfied": self.dissatisfied,
            "feedback_events": self.feedback_events,
            "sessions": list(self.sessions),
        }, separators=(",", ":"))

    @staticmethod
    def from_json(data: str | bytes) -> Window:
        d: dict[str, Any] = json.loads(data)
        decision = d["decision"]
        return Window(
            request_id=d["request_id"],
            opened_at=d["opened_at"],
            last_event_at=d["last_event_at"],
            event_ids=frozenset(d["event_ids"]),
            served=None if d["served"] is None else CompletionServed.model_validate(d["served"]),
            served_seen_at=d["served_seen_at"],
            decision=None if decision is None else (float(decision[0]), bool(decision[1])),
            decided_at=d["decided_at"],
            persistence={int(h): (float(v[0]), int(v[1]), int(v[2])) for h, v in d["persistence"].items()},
            final_horizon_at=d["final_horizon_at"],
            dissatisfied=d["dissatisfied"],
            feedback_events=d["feedback_events"],
            sessions=tuple(d.get("sessions", ())),  # absent in windows stored before sessions
        )


def open_window(request_id: str, now: float) -> Window:
    return Window(request_id=request_id, opened_at=now, last_event_at=now)


def apply(window: Window | None, event: Event, now: float, spec: RewardSpec) -> Window:
    """The window after ``event``; the same window when the event was already applied."""
    w = window if window is not None else open_window(event.request_id, now)
    if event.request_id != w.request_id:
        raise ValueError(f"event for {event.request_id} applied to window {w.request_id}")
    if event.event_id in w.event_ids:
        return w
    changes: dict[str, Any] = {"event_ids": w.event_ids | {event.event_id}, "last_event_at": now}
    if isinstance(event, CompletionServed):
        if w.served is None:  # a second served event with a new id for one request is ignored
            changes.update(served=event, served_seen_at=now)
        return replace(w, **changes)
    changes["feedback_events"] = w.feedback_events + 1
    changes.update(_feedback_changes(w, event, now, spec))
    return replace(w, **changes)


def _feedback_changes(w: Window, event: Event, now: float, spec: RewardSpec) -> dict[str, Any]:
    """The fields a feedback event changes besides its id, its time and the feedback count."""
    ts = event.ts.timestamp()
    if isinstance(event, EditAccepted | EditRejected):
        accepted = isinstance(event, EditAccepted)
        return {"decision": (ts, accepted), "decided_at": now} if supersedes(w.decision, ts, accepted) else {}
    if isinstance(event, EditPersistence):
        return _persistence_changes(w, event, ts, now, spec)
    if isinstance(event, FollowupDissatisfied):
        return {"dissatisfied": w.dissatisfied + 1}
    if isinstance(event, SessionTurn) and event.session_id not in w.sessions and len(w.sessions) < MAX_CLAIMS:
        return {"sessions": (*w.sessions, event.session_id)}
    return {}


def _persistence_changes(w: Window, event: EditPersistence, ts: float, now: float,
                         spec: RewardSpec) -> dict[str, Any]:
    """The latest report per horizon wins (by producer ts; a later-applied one wins a tie);
    the largest horizon's first report is when the window may close."""
    changes: dict[str, Any] = {}
    old_p = w.persistence.get(event.horizon_s)
    if old_p is None or ts >= old_p[0]:
        changes["persistence"] = {
            **w.persistence, event.horizon_s: (ts, event.retained_chars, event.inserted_chars)}
    if event.horizon_s >= spec.persistence.max_horizon_s and w.final_horizon_at is None:
        changes["final_horizon_at"] = now
    return changes


def due_at(window: Window, spec: RewardSpec, time_scale: float = 1.0) -> float:
    """When the window closes at the latest: opened + (largest horizon + grace) * scale."""
    return window.opened_at + spec.window_s * time_scale


def supersedes(current: tuple[float, bool] | None, ts: float, accepted: bool) -> bool:
    """Whether an accept/reject event with producer time ``ts`` replaces the ``current``
    decision (producer ts, accepted): the latest wins, and on a tie a rejection wins."""
    return current is None or ts > current[0] or (ts == current[0] and not accepted)


def early_close(completion_kind: str | None, served_seen_at: float | None, rejected_at: float | None,
                final_horizon_at: float | None, followup: float) -> float | None:
    """When a window closes before its due time because nothing more is expected, or None.

    ``served_seen_at``: when the served event was seen (None: not yet, nothing closes early);
    ``rejected_at``: when the decision that stands, if a rejection, was seen;
    ``final_horizon_at``: when the largest horizon's persistence was first seen;
    ``followup``: the wait for a dissatisfied follow-up (``followup_s * time_scale``).
    Times are on one clock (the reward worker's processing time; ``rtrl reconcile`` uses the
    forwarded records' Kafka time)."""
    if completion_kind is None or served_seen_at is None:
        return None
    if completion_kind != "edit":
        return served_seen_at + followup
    if rejected_at is not None:
        return rejected_at + followup
    if final_horizon_at is not None:
        return max(served_seen_at, final_horizon_at)
    return None


def close_at(window: Window, spec: RewardSpec, time_scale: float = 1.0) -> float:
    """When the window closes: its due time, or earlier when nothing more is expected."""
    due = due_at(window, spec, time_scale)
    rejected = window.decision is not None and not window.decision[1]
    early = early_close(
        None if window.served is None else window.served.completion_kind, window.served_seen_at,
        window.decided_at if rejected else None, window.final_horizon_at,
        spec.window.followup_s * time_scale)
    return due if early is None else min(due, early)


@dataclass(frozen=True)
class BatchResult:
    windows: dict[str, Window]
    """Windows that changed (new or updated), by request id."""
    late: list[Event]
    """Events for requests whose reward was already emitted: counted, never re-emitted."""
    duplicates: int
    """Events already applied to their window (replays after a restart)."""


def apply_batch(
    windows: Mapping[str, Window | None],
    emitted: Iterable[str],
    events: Iterable[Event],
    now: float,
    spec: RewardSpec,
) -> BatchResult:
    """Apply a batch of events to the windows they belong to."""
    done = set(emitted)
    current: dict[str, Window | None] = dict(windows)
    changed: dict[str, Window] = {}
    late: list[Event] = []
    duplicates = 0
    for ev in events:
        if ev.request_id in done:
            late.append(ev)
            continue
        before = current.get(ev.request_id)
        after = apply(before, ev, now, spec)
        if after is before:
            duplicates += 1
            continue
        current[ev.request_id] = after
        changed[ev.request_id] = after
    return BatchResult(changed, late, duplicates)


@dataclass(frozen=True)
class Closed:
    """The outcome of closing one window: a reward, or an orphan (feedback without served)."""

    request_id: str
    record: RewardRecord | None
    orphan_events: int = 0


def close(window: Window, spec: RewardSpec, now: float) -> Closed:
    """Turn a window into its reward record (or an orphan when served never came)."""
    s = window.served
    if s is None:
        return Closed(window.request_id, None, orphan_events=max(1, window.feedback_events))
    fb = window.feedback()
    reward, components = compute_reward(fb, s, spec)
    record = RewardRecord(
        request_id=s.request_id,
        served_event_id=s.event_id,
        session_id=s.session_id,
        user_key=s.user_key,
        served_ts=s.ts,
        closed_ts=datetime.fromtimestamp(now, UTC),
        model=s.model,
        arm=s.arm,
        prompt_tokens=list(s.prompt_tokens),
        completion_tokens=list(s.completion_tokens),
        behavior_logprobs=list(s.logprobs),
        temperature=s.temperature,
        latency_ms=s.latency_ms,
        completion_kind=s.completion_kind,
        tool_calls=s.tool_calls,
        invalid_tool_calls=s.invalid_tool_calls,
        accepted=fb.accepted if s.completion_kind == "edit" else None,
        persistence={
            str(h): (r / i if i > 0 else 0.0) for h, (r, i) in sorted(fb.persistence.items())
        } if s.completion_kind == "edit" else {},
        dissatisfied=fb.dissatisfied,
        reward=reward,
        components=components,
        reward_spec_version=spec.version,
        defaulted=not has_feedback(fb, s.completion_kind),
    )
    return Closed(window.request_id, record)
