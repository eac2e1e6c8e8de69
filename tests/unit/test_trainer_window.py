"""Data windows: planning from the cut to the watermark, retrying a pending window, the
held-out split, skipping small windows, and parsing records."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

from ingest.events import ModelRef, RewardRecord
from trainer.adapters.memory import InMemoryRewardLog
from trainer.window import (
    PartitionRange,
    PendingWindow,
    Window,
    is_heldout,
    parse_records,
    plan_window,
    resume_or_plan,
    skip_reason,
)


def record(i: int, reward: float = 1.0) -> bytes:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    return RewardRecord(
        request_id=f"r{i}", served_event_id=f"e{i}", session_id="s", user_key="u", served_ts=now,
        closed_ts=now, model=ModelRef(name="rtrl-policy", version="1"), arm="stable",
        prompt_tokens=[0, 5], completion_tokens=[7, 1], behavior_logprobs=[-1.0, -0.5],
        latency_ms=10.0, reward=reward, components={"accept": reward}, reward_spec_version="v1",
    ).model_dump_json().encode()


def test_plan_window_from_cut_or_beginning_to_watermark() -> None:
    w = plan_window("t", {0: 5, 1: None, 2: 3}, {0: 0, 1: 2, 2: 4}, {0: 9, 1: 6, 2: 4})
    assert w.ranges == (PartitionRange(0, 5, 9), PartitionRange(1, 2, 6), PartitionRange(2, 4, 4))
    assert w.offsets == 8
    capped = plan_window("t", {0: 0, 1: 0}, {}, {0: 100, 1: 3}, max_offsets=10)
    assert capped.ends() == {0: 5, 1: 3}


def test_window_json_round_trip_and_stable_id() -> None:
    w = Window("t", (PartitionRange(0, 1, 4),), records=3, invalid=0, heldout=1)
    back = Window.from_json(w.to_json())
    assert back == w
    assert json.loads(w.to_json())["id"] == w.id
    assert w.with_counts(9, 9, 9).id == w.id  # counts do not change the identity
    assert Window("t", (PartitionRange(0, 1, 5),)).id != w.id


def test_resume_retries_a_pending_window_at_the_cut_only() -> None:
    log = InMemoryRewardLog("t", partitions=2)
    for i in range(6):
        log.append(i % 2, record(i))
    first, retry = resume_or_plan("t", log, None)
    assert not retry and first.ends() == {0: 3, 1: 3}
    for i in range(6, 10):  # more records arrive while the first attempt fails
        log.append(i % 2, record(i))
    again, retry = resume_or_plan("t", log, first)
    assert retry and again == first  # same offsets: the same Ray run resumes
    log.commit(first)
    nxt, retry = resume_or_plan("t", log, first)  # the pending one is stale now
    assert not retry and nxt.starts() == {0: 3, 1: 3} and nxt.ends() == {0: 5, 1: 5}


def test_each_record_is_read_once_across_windows() -> None:
    log = InMemoryRewardLog("t", partitions=3)
    seen: list[bytes] = []
    for batch in range(4):
        for i in range(batch * 10, batch * 10 + 10):
            log.append(i % 3, record(i))
        w, _ = resume_or_plan("t", log, None)
        seen += [v for _, _, v in log.read(w)]
        log.commit(w)
    assert len(seen) == 40 and len(set(seen)) == 40


def test_parse_records_splits_by_request_hash_and_counts_invalid() -> None:
    values = [record(i) for i in range(200)] + [b"not json", b'{"request_id": "x"}']
    parsed = parse_records(values, heldout_fraction=0.25)
    assert parsed.invalid == 2
    assert len(parsed.train) + len(parsed.heldout) == 200
    assert 30 <= len(parsed.heldout) <= 70
    # the split is a property of the request, stable across calls
    again = parse_records(values, heldout_fraction=0.25)
    assert [r.request_id for r in again.heldout] == [r.request_id for r in parsed.heldout]
    assert all(is_heldout(r.request_id, 0.25) for r in parsed.heldout)
    assert parse_records(values, 0.0).heldout == []


def test_skip_reasons() -> None:
    empty = Window("t", (PartitionRange(0, 4, 4),))
    assert skip_reason(empty, 0, 10) == "no new reward records since the last increment"
    w = Window("t", (PartitionRange(0, 0, 5),))
    reason = skip_reason(w, 5, 10)
    assert reason is not None and "too few records" in reason
    assert skip_reason(w, 10, 10) is None


def test_pending_window_file(tmp_path: Path) -> None:
    pending = PendingWindow(tmp_path / "state" / "pending.json")
    assert pending.load() is None
    w = Window("t", (PartitionRange(1, 2, 3),), records=1)
    pending.save(w)
    assert pending.load() == w
    pending.clear()
    pending.clear()
    assert pending.load() is None
