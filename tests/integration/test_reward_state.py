"""The Redis join-state adapter against a real Redis."""

from __future__ import annotations

from reward_helpers import accepted, served

from ingest.adapters.redis_join import RedisJoinState
from ingest.reward.join import apply
from ingest.reward.spec import load_spec
from services.runtime.redis_io import make_redis
from services.settings.model import Settings

SPEC = load_spec()


def test_save_due_finish_and_checkpoints(settings: Settings) -> None:
    st = RedisJoinState(make_redis(settings.redis), settings.redis.key_prefix, emitted_ttl_s=60)
    w1 = apply(None, served("a"), 100.0, SPEC)
    w2 = apply(apply(None, served("b"), 100.0, SPEC), accepted("b"), 101.0, SPEC)
    due = st.save_and_due({"a": w1, "b": w2}, {"a": 0, "b": 1}, {"a": 150.0, "b": 120.0}, [0, 1], 130.0, 10)
    assert due.rows == [(1, "b", 120.0)] and due.next_at == 150.0
    assert st.save_and_due({}, {}, {}, [1], 130.0, 10).next_at is None  # nothing open later on 1
    assert st.save_and_due({}, {}, {}, [0], 150.0, 10) == ([(0, "a", 150.0)], None)  # due at its time
    more = st.save_and_due({}, {}, {}, [0, 1], 200.0, 1)  # more due than one batch closes
    assert more.rows == [(1, "b", 120.0)] and more.next_at == 200.0
    assert st.due([0, 1], 200.0, 10) == [(1, "b", 120.0), (0, "a", 150.0)]
    assert st.due([0], 200.0, 10) == [(0, "a", 150.0)]
    windows, emitted = st.load(["a", "b", "c"])
    assert windows["a"] == w1 and windows["b"] == w2 and windows["c"] is None and emitted == set()
    assert st.open_stats([0, 1], 200.0) == (2, 80.0)

    st.finish([(1, "b")], [], checkpoints={1: 7})
    windows, emitted = st.load(["a", "b"])
    assert windows["b"] is None and emitted == {"b"}
    assert st.due([0, 1], 200.0, 10) == [(0, "a", 150.0)]
    assert st.checkpoint(1) == 7
    st.mark_recovered(1, ["x", "y"], 5)  # a checkpoint never moves backwards
    assert st.checkpoint(1) == 7
    st.mark_recovered(1, ["z"], 9)
    assert st.checkpoint(1) == 9 and st.load(["x", "z"])[1] == {"x", "z"}
    st.finish([], [(0, "a")])
    assert st.load(["a"]) == ({"a": None}, {"a"}) and st.open_stats([0, 1], 200.0) == (0, 0.0)
    assert st.r.ttl(f"{settings.redis.key_prefix}reward:done:a") > 0
