"""The reward worker against the real broker and Redis (in a thread)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from prometheus_client import REGISTRY
from reward_helpers import (
    accepted,
    dissatisfied,
    full_edit,
    produce,
    read_rewards,
    rejected,
    served,
)

from ingest.reward.spec import load_spec
from services.runtime.process import Stopper
from services.settings.model import Settings
from services.settings.services import RewardSettings
from services.wiring.reward import RewardWorker


def _metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture
def worker(settings: Settings) -> Iterator[tuple[Settings, RewardWorker]]:
    s = settings.model_copy(update={"reward": RewardSettings(time_scale=0.001, poll_timeout_ms=100)})
    w = RewardWorker(s, load_spec()).start()
    stopper = Stopper()
    t = threading.Thread(target=w.run, args=(stopper,), daemon=True)
    t.start()
    yield s, w
    stopper.stop()
    t.join(10)
    w.close()


def test_one_reward_per_served_request_with_components(worker: tuple[Settings, RewardWorker]) -> None:
    s, w = worker
    # a rebalance waits for members to rejoin this long at most, not kafka-python's 5 minutes
    assert w.loops[0].consumer.config["max_poll_interval_ms"] == s.reward.max_poll_interval_ms == 30_000
    late0 = _metric("rtrl_reward_late_events_total", type="followup.dissatisfied")
    orph0 = _metric("rtrl_reward_orphan_events_total")
    events = [
        *full_edit("edit1", kept=80),
        served("rej1", latency_ms=3000.0), rejected("rej1"), dissatisfied("rej1"),
        served("q1", kind="question", arm="canary"),
        served("none1", tool_calls=3, invalid_tool_calls=2),
        accepted("orphan1"),
    ]
    produce(s, [*events, events[0]])  # a duplicate served event changes nothing
    recs = {r["request_id"]: r for r in read_rewards(s, expect=4, timeout_s=30, settle_s=0.5)}
    assert set(recs) == {"edit1", "rej1", "q1", "none1"}
    e = recs["edit1"]
    assert e["reward"] == pytest.approx(0.75 + 0.8) and e["accepted"] is True
    assert e["persistence"] == {"30": 1.0, "600": 0.8, "3600": 0.4}
    assert e["reward_spec_version"] == "default-v1" and e["completion_tokens"] == [4, 5]
    assert e["behavior_logprobs"] == [-0.5, -0.25] and e["model"] == {"name": "tiny", "version": "1"}
    r = recs["rej1"]
    assert r["components"]["acceptance"] == -0.25 and r["components"]["dissatisfied"] == -0.5
    assert r["components"]["latency"] == pytest.approx(-0.05)
    assert r["reward"] == pytest.approx(-0.8)
    q = recs["q1"]
    assert q["defaulted"] and q["reward"] == 0.0 and q["arm"] == "canary" and q["accepted"] is None
    n = recs["none1"]
    assert n["defaulted"] and n["components"]["invalid_tool_calls"] == -0.5 and n["reward"] == -0.5

    # a follow-up for an emitted request is late: counted, never re-emitted
    produce(s, [dissatisfied("edit1")])
    deadline = time.monotonic() + 10
    while _metric("rtrl_reward_late_events_total", type="followup.dissatisfied") == late0:
        assert time.monotonic() < deadline, "late event not counted"
        time.sleep(0.1)
    # the orphan (feedback without served) expires at its due time (3.63 s) without a reward
    while _metric("rtrl_reward_orphan_events_total") == orph0:
        assert time.monotonic() < deadline + 10, "orphan not expired"
        time.sleep(0.1)
    again = read_rewards(s, expect=5, timeout_s=1.0)
    assert sorted(x["request_id"] for x in again) == ["edit1", "none1", "q1", "rej1"]
