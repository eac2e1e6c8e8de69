"""Redis adapter for the reward worker's session stage (ingest/reward/session_stage.py).

Keys (under ``RedisSettings.key_prefix`` + ``reward:``):

    s:<session_id>       hash: ``e:<event_id>`` forwarded events, ``n:<request_id>`` turn
                         notes (first write wins, so a replayed batch changes nothing),
                         ``first`` / ``last`` / ``end`` processing times, ``p`` its partition
    sdue:<partition>     sorted set: session_id scored by when to look at it next
    sdone:<session_id>   set of the request ids a credited session handled (and ``*``), TTL
    sckpt:<partition>    sessions-topic offset below which every Credited marker is applied

Partitions are those of the sessions topic. Every call is one or two round trips.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from ingest.adapters.redis_join import MAX_SET
from ingest.contracts.keys import reward_join_prefix
from ingest.events import SessionEnd
from ingest.reward.session_stage import ForwardedEvent, SessionState, TurnNote, may_close_at
from ingest.reward.spec import RewardSpec

NOTE_RECHECK_S = 1.0
"""A session touched by notes only is looked at again this soon at the earliest."""
CREDITED = "*"
"""Member of ``sdone:<session_id>`` that says the session was credited."""


@dataclass
class Touch:
    """What one batch brings to one session."""

    partition: int
    events: list[ForwardedEvent] = field(default_factory=list)
    notes: list[TurnNote] = field(default_factory=list)


@dataclass(frozen=True)
class Handled:
    """A session's Credited marker, to apply once committed (or found by recovery)."""

    partition: int
    session_id: str
    request_ids: tuple[str, ...]
    closed: bool = True


def next_look(close_at: float | None, scheduled: Any, with_events: bool, now: float) -> float | None:
    """When to look at a touched session next (None: leave its timer as it is). Events set it
    to when the session may close. Notes only bring it forward to ``NOTE_RECHECK_S`` from now at
    the earliest: a closed session waiting for its notes is not loaded whole once per batch."""
    if close_at is None or with_events:
        return close_at
    at = max(close_at, now + NOTE_RECHECK_S)
    return None if scheduled is not None and float(scheduled) <= at else at


class RedisSessionState:
    def __init__(self, client: redis.Redis, prefix: str, done_ttl_s: int) -> None:
        self.r = client
        self.p = reward_join_prefix(prefix)
        self.done_ttl_s = done_ttl_s

    def _s(self, sid: str) -> str:
        return f"{self.p}s:{sid}"

    def _done(self, sid: str) -> str:
        return f"{self.p}sdone:{sid}"

    def _due(self, partition: int) -> str:
        return f"{self.p}sdue:{partition}"

    def _ckpt(self, partition: int) -> str:
        return f"{self.p}sckpt:{partition}"

    # ------------------------------------------------------------------ reads
    def handled(self, session_ids: Iterable[str]) -> dict[str, set[str]]:
        """The handled request ids of the credited sessions among these (absent: not credited)."""
        sids = list(dict.fromkeys(session_ids))
        pipe = self.r.pipeline(transaction=False)
        for sid in sids:
            pipe.smembers(self._done(sid))
        out: dict[str, set[str]] = {}
        for sid, members in zip(sids, pipe.execute(), strict=True):
            ids = {m.decode() if isinstance(m, bytes) else m for m in members}
            if CREDITED in ids:
                out[sid] = ids - {CREDITED}
        return out

    def load(self, session_id: str) -> SessionState:
        raw: dict[Any, Any] = self.r.hgetall(self._s(session_id))
        events, notes, scalars = {}, {}, {}
        for k, v in raw.items():
            key = k.decode() if isinstance(k, bytes) else k
            if key.startswith("e:"):
                events[key[2:]] = ForwardedEvent.model_validate_json(v).event
            elif key.startswith("n:"):
                notes[key[2:]] = TurnNote.model_validate_json(v)
            else:
                scalars[key] = float(v)
        return SessionState(session_id, events, notes, scalars.get("first"), scalars.get("last"),
                            scalars.get("end"))

    def due(self, partitions: Sequence[int], now: float, limit: int
            ) -> tuple[list[tuple[int, str]], float | None]:
        """(partition, session_id) due by ``now`` (earliest first, at most ``limit``), and the
        next time one is due (``now`` when more than ``limit`` are)."""
        pipe = self.r.pipeline(transaction=False)
        for p in partitions:
            pipe.zrangebyscore(self._due(p), "-inf", now, start=0, num=limit + 1, withscores=True)
            pipe.zrangebyscore(self._due(p), f"({now}", "+inf", start=0, num=1, withscores=True)
        res = pipe.execute()
        rows: list[tuple[float, int, str]] = []
        upcoming: list[float] = []
        for i, p in enumerate(partitions):
            rows += [(score, p, m.decode() if isinstance(m, bytes) else m) for m, score in res[2 * i]]
            upcoming += [score for _, score in res[2 * i + 1]]
        rows.sort()
        if len(rows) > limit:
            return [(p, sid) for _, p, sid in rows[:limit]], now
        return [(p, sid) for _, p, sid in rows], min(upcoming, default=None)

    def open_count(self, partitions: Iterable[int]) -> int:
        pipe = self.r.pipeline(transaction=False)
        for p in partitions:
            pipe.zcard(self._due(p))
        return int(sum(pipe.execute()))

    def checkpoint(self, partition: int) -> int:
        v = self.r.get(self._ckpt(partition))
        return int(v) if v is not None else 0

    # ------------------------------------------------------------------ writes
    def apply(self, touched: Mapping[str, Touch], now: float, spec: RewardSpec, scale: float) -> None:
        """Store a batch's events and notes (first write wins) and set each touched session's
        next look (idempotent: a replayed batch only moves ``last`` to its own time)."""
        sids = list(touched)
        if not sids:
            return
        pipe = self.r.pipeline(transaction=False)
        for sid in sids:
            pipe.hmget(self._s(sid), "first", "last", "end")
            pipe.zscore(self._due(touched[sid].partition), sid)
        res = pipe.execute()
        before = [(*res[2 * i], res[2 * i + 1]) for i in range(len(sids))]
        pipe = self.r.pipeline(transaction=True)
        for sid, (first, last, end, scheduled) in zip(sids, before, strict=True):
            t = touched[sid]
            key = self._s(sid)
            for ev in t.events:
                pipe.hsetnx(key, f"e:{ev.event.event_id}", ev.model_dump_json())
            for n in t.notes:
                pipe.hsetnx(key, f"n:{n.request_id}", n.model_dump_json())
            first_t = now if first is None else float(first)
            last_t = None if last is None else float(last)
            end_t = None if end is None else float(end)
            fields: dict[str, float | int] = {"first": first_t, "p": t.partition}
            if t.events:
                last_t = max(now, last_t or now)
                fields["last"] = last_t
            if end_t is None and any(isinstance(e.event, SessionEnd) for e in t.events):
                end_t = fields["end"] = now
            pipe.hset(key, mapping=fields)  # type: ignore[arg-type]
            at = next_look(may_close_at(first_t, last_t, end_t, spec, scale), scheduled, bool(t.events), now)
            if at is not None:
                pipe.zadd(self._due(t.partition), {sid: at})
        pipe.execute()

    def reschedule(self, rows: Iterable[tuple[int, str, float | None]]) -> None:
        """Set when to look at each session next; None drops its timer."""
        pipe = self.r.pipeline(transaction=False)
        for p, sid, at in rows:
            if at is None:
                pipe.zrem(self._due(p), sid)
            else:
                pipe.zadd(self._due(p), {sid: at})
        pipe.execute()

    def finish(self, handled: Iterable[Handled], checkpoints: Mapping[int, int] | None = None) -> None:
        """After the records are committed: remember what each session handled, drop the
        closed sessions' state and timers, advance checkpoints (one atomic round trip)."""
        pipe = self.r.pipeline(transaction=True)
        for h in handled:
            pipe.sadd(self._done(h.session_id), CREDITED, *h.request_ids)
            pipe.expire(self._done(h.session_id), self.done_ttl_s)
            if h.closed:
                pipe.delete(self._s(h.session_id))
                pipe.zrem(self._due(h.partition), h.session_id)
        for p, off in (checkpoints or {}).items():
            pipe.eval(MAX_SET, 1, self._ckpt(p), off)
        pipe.execute()
