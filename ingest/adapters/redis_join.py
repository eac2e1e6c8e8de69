"""Redis adapter for the reward join: windows, due timers, emitted markers, checkpoints.

Keys (all under ``RedisSettings.key_prefix``):

    reward:w:<request_id>     the request's window (JSON of ingest.reward.join.Window)
    reward:due:<partition>    sorted set: request_id scored by its close time (Unix s)
    reward:done:<request_id>  "1" (emitted) or "orphan", with a TTL; marks late events
    reward:ckpt:<partition>   rewards-topic offset below which every record is marked done

Partitions are those of the events topic; any worker that owns a partition can read and
close its windows, so a partition moves between workers without losing state. Every call
is one Redis round trip (pipelines), whatever the batch size.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import redis

from ingest.contracts.keys import reward_join_prefix
from ingest.reward.join import Window


class Due(NamedTuple):
    """What :meth:`RedisJoinState.save_and_due` found on the partitions it was asked about."""

    rows: list[tuple[int, str, float]]
    """(partition, request_id, close time) of the windows due by ``now``, earliest first
    (at most ``limit``)."""
    next_at: float | None
    """When the next window closes: the earliest close time after ``now`` (``now`` itself
    when more than ``limit`` are due; None when no window is open)."""


class RedisJoinState:
    def __init__(self, client: redis.Redis, prefix: str, emitted_ttl_s: int) -> None:
        self.r = client
        self.p = reward_join_prefix(prefix)
        self.emitted_ttl_s = emitted_ttl_s

    def _w(self, rid: str) -> str:
        return f"{self.p}w:{rid}"

    def _done(self, rid: str) -> str:
        return f"{self.p}done:{rid}"

    def _due(self, partition: int) -> str:
        return f"{self.p}due:{partition}"

    def _ckpt(self, partition: int) -> str:
        return f"{self.p}ckpt:{partition}"

    # ------------------------------------------------------------------ reads
    def load(self, request_ids: Iterable[str]) -> tuple[dict[str, Window | None], set[str]]:
        """Windows and emitted markers of these requests (one round trip)."""
        rids = list(dict.fromkeys(request_ids))
        if not rids:
            return {}, set()
        values = self.r.mget([self._w(r) for r in rids] + [self._done(r) for r in rids])
        n = len(rids)
        windows = {
            rid: (Window.from_json(v) if v is not None else None)
            for rid, v in zip(rids, values[:n], strict=True)
        }
        emitted = {rid for rid, v in zip(rids, values[n:], strict=True) if v is not None}
        return windows, emitted

    def due(self, partitions: Iterable[int], now: float, limit: int) -> list[tuple[int, str, float]]:
        """(partition, request_id, close time) of windows due by ``now``, earliest first."""
        return self.save_and_due({}, {}, {}, partitions, now, limit).rows

    def save_and_due(self, windows: Mapping[str, Window], partition_of: Mapping[str, int],
                     close_times: Mapping[str, float], partitions: Iterable[int], now: float,
                     limit: int) -> Due:
        """Store changed windows and their close times, then list the windows due by ``now``
        on ``partitions`` (earliest first) and the next close time, in one atomic round trip
        (MULTI: a window is never stored without its timer, which a replay could not repair
        since it changes nothing)."""
        parts = sorted(partitions)
        pipe = self.r.pipeline(transaction=True)
        self._queue_save(pipe, windows, partition_of, close_times)
        for p in parts:
            pipe.zrangebyscore(self._due(p), "-inf", now, start=0, num=limit + 1, withscores=True)
            pipe.zrangebyscore(self._due(p), f"({now!r}", "+inf", start=0, num=1, withscores=True)
        if not len(pipe):
            return Due([], None)
        res = pipe.execute()
        res = res[len(res) - 2 * len(parts):]
        out, later = [], []
        for p, rows, after in zip(parts, res[0::2], res[1::2], strict=True):
            out += [(p, m.decode() if isinstance(m, bytes) else str(m), float(s)) for m, s in rows]
            later += [float(s) for _, s in after]
        out.sort(key=lambda t: t[2])
        next_at = now if len(out) > limit else min(later, default=None)
        return Due(out[:limit], next_at)

    def open_stats(self, partitions: Iterable[int], now: float) -> tuple[int, float]:
        """(open windows, seconds the most overdue one is past its close time) for partitions."""
        parts = sorted(partitions)
        if not parts:
            return 0, 0.0
        pipe = self.r.pipeline(transaction=False)
        for p in parts:
            pipe.zcard(self._due(p))
            pipe.zrange(self._due(p), 0, 0, withscores=True)
        res = pipe.execute()
        count = sum(int(c) for c in res[0::2])
        firsts = [rows[0][1] for rows in res[1::2] if rows]
        overdue = max(0.0, now - min(firsts)) if firsts else 0.0
        return count, overdue

    def checkpoint(self, partition: int) -> int:
        v = self.r.get(self._ckpt(partition))
        return int(v) if v is not None else 0

    # ------------------------------------------------------------------ writes
    def save(self, windows: Mapping[str, Window], partition_of: Mapping[str, int],
             close_times: Mapping[str, float]) -> None:
        """Store changed windows and their close times (idempotent; one round trip)."""
        if not windows:
            return
        pipe = self.r.pipeline(transaction=True)
        self._queue_save(pipe, windows, partition_of, close_times)
        pipe.execute()

    def _queue_save(self, pipe: Any, windows: Mapping[str, Window], partition_of: Mapping[str, int],
                    close_times: Mapping[str, float]) -> None:
        for rid, w in windows.items():
            pipe.set(self._w(rid), w.to_json())
        by_part: dict[int, dict[str, float]] = {}
        for rid in windows:
            by_part.setdefault(partition_of[rid], {})[rid] = close_times[rid]
        for p, scores in by_part.items():
            pipe.zadd(self._due(p), scores)

    def finish(self, emitted: Iterable[tuple[int, str]], orphans: Iterable[tuple[int, str]],
               stale: Iterable[tuple[int, str]] = (), checkpoints: Mapping[int, int] | None = None) -> None:
        """After the rewards are committed to Kafka: mark them emitted, drop their windows and
        timers, and advance the rewards-topic checkpoints (one atomic round trip).
        ``stale`` are timers whose window is gone or already emitted: only the timer goes."""
        pipe = self.r.pipeline(transaction=True)
        for marker, rows in (("1", emitted), ("orphan", orphans)):
            for p, rid in rows:
                pipe.set(self._done(rid), marker, ex=self.emitted_ttl_s)
                pipe.delete(self._w(rid))
                pipe.zrem(self._due(p), rid)
        for p, rid in stale:
            pipe.zrem(self._due(p), rid)
        for p, off in (checkpoints or {}).items():
            # never move a checkpoint backwards (another worker may have read further)
            pipe.eval(MAX_SET, 1, self._ckpt(p), off)
        pipe.execute()

    def mark_recovered(self, partition: int, request_ids: Iterable[str], checkpoint: int) -> None:
        """Mark request ids found on the rewards topic as emitted and set the checkpoint."""
        pipe = self.r.pipeline(transaction=True)
        for rid in request_ids:
            pipe.set(self._done(rid), "1", ex=self.emitted_ttl_s)
        pipe.eval(MAX_SET, 1, self._ckpt(partition), checkpoint)
        pipe.execute()


MAX_SET = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
if tonumber(ARGV[1]) > cur then redis.call('SET', KEYS[1], ARGV[1]) end
return 1
"""
