"""Helpers shared by the reward integration tests: events straight onto the events topic,
and a read_committed reader of the rewards topic."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from ingest.events import (
    CompletionServed,
    EditAccepted,
    EditPersistence,
    EditRejected,
    FollowupDissatisfied,
    ModelRef,
    RewardRecord,
)
from services.runtime.kafka_io import ensure_topics, make_consumer, make_producer
from services.settings.model import Settings
from trainer.tokens import BOS

T0 = datetime.now(UTC) - timedelta(minutes=5)


def served(rid: str, kind: str = "edit", arm: str = "stable", **kw: Any) -> CompletionServed:
    return CompletionServed(
        event_id=f"{rid}-s", request_id=rid, ts=T0, session_id="s", user_key=f"u-{rid}",
        model=ModelRef(name="tiny", version="1"), arm=arm,  # type: ignore[arg-type]
        prompt_tokens=[1, 2, 3], completion_tokens=[4, 5], logprobs=[-0.5, -0.25],
        latency_ms=kw.pop("latency_ms", 500.0), completion_kind=kind, **kw,  # type: ignore[arg-type]
    )


def accepted(rid: str) -> EditAccepted:
    return EditAccepted(event_id=f"{rid}-a", request_id=rid, ts=T0, inserted_chars=100)


def rejected(rid: str) -> EditRejected:
    return EditRejected(event_id=f"{rid}-r", request_id=rid, ts=T0)


def persisted(rid: str, h: int, kept: int) -> EditPersistence:
    return EditPersistence(event_id=f"{rid}-p{h}", request_id=rid, ts=T0 + timedelta(seconds=1),
                           horizon_s=h, retained_chars=kept, inserted_chars=100)


def dissatisfied(rid: str) -> FollowupDissatisfied:
    return FollowupDissatisfied(event_id=f"{rid}-d", request_id=rid, ts=T0)


def full_edit(rid: str, kept: int = 80) -> list[Any]:
    return [served(rid), accepted(rid), persisted(rid, 30, 100), persisted(rid, 600, kept),
            persisted(rid, 3600, kept // 2)]


def interleave(streams: list[list[Any]], rng: random.Random) -> list[Any]:
    """A random merge that keeps each stream's own event order."""
    queues = [list(reversed(st)) for st in streams]
    out = []
    while queues:
        q = rng.choice(queues)
        out.append(q.pop())
        if not q:
            queues.remove(q)
    return out


def kill_rounds(rounds: list[dict[str, str]], start: Callable[[dict[str, str]], subprocess.Popen[bytes]],
                rng: random.Random, before: Callable[[int], None] = lambda _i: None) -> int:
    """Start a worker per round with the round's extra environment; a round with a crash point
    gets 15 s to die by it, one without is SIGKILLed from outside after 3-6 s. ``before(i)``
    runs ahead of round ``i``. Returns how many workers died by SIGKILL."""
    kills = 0
    for i, extra in enumerate(rounds):
        before(i)
        proc = start(extra)
        limit = time.monotonic() + (rng.uniform(3, 6) if not extra else 15)
        while proc.poll() is None and time.monotonic() < limit:
            time.sleep(0.05)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        kills += proc.returncode == -signal.SIGKILL
    return kills


def produce(settings: Settings, events: list[Any]) -> None:
    ensure_topics(settings, [settings.topics.events, settings.topics.rewards])
    prod = make_producer(settings.kafka)
    for ev in events:
        prod.send(settings.topics.events, value=ev.model_dump_json().encode(), key=ev.request_id.encode())
    prod.flush()
    prod.close()


def read_rewards(settings: Settings, expect: int, timeout_s: float = 30.0,
                 settle_s: float = 0.0, isolation: str = "read_committed") -> list[dict[str, Any]]:
    """Read the rewards topic (read_committed) until ``expect`` records, then ``settle_s``
    more seconds (to see duplicates that would follow)."""
    c = make_consumer(settings.kafka, None, [settings.topics.rewards], isolation_level=isolation)
    out: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout_s
    settle_until: float | None = None
    try:
        while time.monotonic() < deadline:
            for recs in c.poll(timeout_ms=200).values():
                out += [json.loads(r.value) for r in recs]
            if len(out) >= expect and settle_until is None:
                settle_until = time.monotonic() + settle_s
            if settle_until is not None and time.monotonic() >= settle_until:
                break
    finally:
        c.close()
    return out


def reward_record(i: int, user: str, prompt: list[int] | None = None, tokens: list[int] | None = None,
                  logps: list[float] | None = None, reward: float = 1.0) -> RewardRecord:
    """One reward record served by v1 to ``user``."""
    now = datetime.now(UTC)
    prompt, tokens = prompt or [BOS, 3, 10], tokens or [7, 1]
    return RewardRecord(
        request_id=f"req-{i}", served_event_id=f"ev-{i}", session_id=f"s{i % 9}", user_key=user,
        served_ts=now, closed_ts=now, model=ModelRef(name="rtrl-policy", version="1"),
        arm="canary" if i % 5 == 0 else "stable", prompt_tokens=prompt, completion_tokens=tokens,
        behavior_logprobs=logps or [-1.0] * len(tokens), latency_ms=12.0, reward=reward,
        components={"accept": reward}, reward_spec_version="default-v1",
    )
