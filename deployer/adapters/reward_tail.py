"""The deployer's readers of the rewards topic: a canary's window, and the long-term holdout's.

Both re-read the topic from a start time (``offsets_for_times``) whenever what they measure
changes (a new canary, a new holdout or champion, a restart) and then follow it, a bounded
number of polls per tick, into a pure window of deployer/cohorts.py.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

from ingest.adapters.idle_poll import IdlePoller
from ingest.adapters.redis_json import read_json, write_json
from ingest.contracts import prometheus as m
from ingest.contracts.keys import holdout_report_key
from ingest.contracts.metrics import PERSISTENCE_HORIZON_S
from ingest.events import RewardRecord
from kafka import TopicPartition
from pydantic import ValidationError
from rollback.types import JudgePolicy

from deployer import cohorts, holdout
from deployer.adapters.served_counts import read_counts
from deployer.routing import Holdout
from deployer.status import CanaryStatus

log = logging.getLogger("rtrl.deployer")


class RewardTail:
    """A consumer without a group over every partition of the rewards topic."""

    def __init__(self, consumer: Any, topic: str, poll_ms: int) -> None:
        self.topic = topic
        self.poll_ms = poll_ms
        self.consumer = consumer
        """A kafka-python consumer without a group (``group_id=None``): reading never moves
        a committed offset."""
        self.invalid = 0

    def seek(self, since: float) -> None:
        """Read from the first record appended at or after ``since`` (Unix seconds)."""
        parts = self.consumer.partitions_for_topic(self.topic) or set()
        if not parts:
            raise RuntimeError(f"rewards topic {self.topic} has no partitions (does it exist?)")
        tps = [TopicPartition(self.topic, p) for p in sorted(parts)]
        self.consumer.assign(tps)
        found = self.consumer.offsets_for_times({tp: int(since * 1000) for tp in tps})
        for tp in tps:
            hit = found.get(tp)
            if hit is None:
                self.consumer.seek_to_end(tp)
            else:
                self.consumer.seek(tp, hit.offset)

    def follow(self, window: cohorts.CohortWindow, polls: int = 100, quiet_polls: int = 3) -> None:
        """Add what arrived since the last call to ``window``. Bounded: a tick never spins
        forever on a busy topic (the rest is read on the next one), and stops after
        ``quiet_polls`` empty non-blocking polls (10, 20, 40 ms apart: time for the fetch
        the first one sent to come back) rather than spin for ``poll_ms`` on a broker that
        answers empty fetches at once."""
        poller = IdlePoller(self.consumer, idle_ms=self.poll_ms)
        quiet = 0
        for _ in range(polls):
            batch = poller.poll(max_records=5000)
            if not any(batch.values()):
                quiet += 1
                if quiet >= quiet_polls:
                    break
                continue
            quiet = 0
            for records in batch.values():
                for rec in records:
                    window.read(rec.partition, rec.offset)
                    try:
                        window.add(RewardRecord.model_validate_json(rec.value))
                    except ValidationError:
                        self.invalid += 1

    def close(self) -> None:
        self.consumer.close()


class RewardReader(RewardTail):
    """Reward records of the current canary's window, re-read from the rewards topic from
    the canary's start time whenever the canary changes (also after a restart)."""

    def __init__(self, consumer: Any, topic: str, poll_ms: int, redis_client: Callable[[], Any],
                 key_prefix: str, horizon_s: int = PERSISTENCE_HORIZON_S) -> None:
        super().__init__(consumer, topic, poll_ms)
        self.horizon_s = horizon_s
        """Edit persistence is judged at this horizon."""
        self.window: cohorts.CohortWindow | None = None
        self.canary_id: str | None = None
        self._connect_redis = redis_client
        """Opens the Redis client of the gateway's counts, on first use."""
        self._prefix = key_prefix
        self._redis: object | None = None

    def served_counts(self, status: CanaryStatus
                      ) -> tuple[dict[str, int], dict[str, int], dict[str, list[tuple[str, float, int]]]]:
        """The gateway's per-arm request and error counts since the canary started, and the
        errors by user (deployer/adapters/served_counts.py): failed requests never make a reward
        record, so the error rate and its guardrail need them."""
        assert status.stable is not None and status.candidate is not None
        if self._redis is None:
            self._redis = self._connect_redis()
        versions = {"stable": status.stable, "canary": status.candidate}
        return read_counts(self._redis, self._prefix, versions, status.started_at)

    def read(self, status: CanaryStatus) -> cohorts.CohortWindow:
        if self.window is None or status.canary_id != self.canary_id:
            assert status.stable is not None and status.candidate is not None
            self.seek(status.started_at)
            self.window = cohorts.CohortWindow(status.stable, status.candidate, status.started_at,
                                               horizon_s=self.horizon_s)
            self.canary_id = status.canary_id
        self.follow(self.window)
        return self.window


class HoldoutMonitor:
    """Measures the champion against the long-term holdout every ``every_s`` seconds.

    The comparison covers the current champion's time since it began serving while this
    holdout was in force (``since``: the holdout's start, or when the deployer first saw the
    new champion; kept in the stored report across restarts), in time strata like a canary's.
    Each measurement is stored in Redis for ``rtrl status``, exported as metrics and logged to
    the holdout's ledger run."""

    def __init__(self, tail: Callable[[], RewardTail], policy: JudgePolicy, redis_client: Any,
                 key_prefix: str, record: Callable[[str, float, dict[str, float]], None],
                 every_s: float) -> None:
        self.open_tail, self.policy, self.r = tail, policy, redis_client
        """``open_tail`` opens the rewards topic's reader on the first measurement."""
        self.prefix = key_prefix
        self.record = record
        """(holdout id, time, metrics) -> the ledger step."""
        self.every_s = every_s
        self.tail: RewardTail | None = None
        self.window: cohorts.HoldoutWindow | None = None
        self.key: tuple[str, str] | None = None
        self.last_at = -math.inf

    def _since(self, h: Holdout, champion: str, now: float) -> float:
        stored = read_holdout_report(self.r, self.prefix)
        if stored is None or stored.get("holdout_id") != h.id:
            return h.started_at  # a new holdout: the champion of its start serves from there
        if stored.get("champion") == champion:
            return float(stored.get("since", h.started_at))
        return now  # a new champion

    def due(self, now: float) -> bool:
        """Whether ``every_s`` has passed since the last measurement."""
        return now - self.last_at >= self.every_s

    def measure(self, h: Holdout | None, champion: str | None, now: float) -> dict[str, Any] | None:
        """One measurement; None when there is nothing to compare."""
        self.last_at = now
        m.HOLDOUT_ACTIVE.set(1.0 if h is not None and h.active(now) else 0.0)
        if h is None or champion is None or not h.active(now):
            if self.window is not None:
                self.window, self.key = None, None
            return None
        if self.key != (h.id, champion) or self.window is None:
            since = self._since(h, champion, now)
            if self.tail is None:
                self.tail = self.open_tail()
            self.tail.seek(since)
            self.window = cohorts.HoldoutWindow(h.version, champion, since,
                                                horizon_s=self.policy.persistence_horizon_s)
            self.key = (h.id, champion)
        self.tail.follow(self.window)  # type: ignore[union-attr]
        got = holdout.measure(self.window, self.policy, now)
        rep = holdout.report(h, champion, self.window.started_at, now, got.effects, got.level)
        rep["users"] = {"holdout": got.users_holdout, "champion": got.users_champion}
        write_json(self.r, holdout_report_key(self.prefix), rep)
        for e in got.effects:
            for stat, value in (("estimate", e.estimate), ("lower", e.lower), ("upper", e.upper),
                                ("relative", e.relative)):
                m.HOLDOUT_EFFECT.labels(e.metric, stat).set(value)
        m.HOLDOUT_USERS.labels("holdout").set(got.users_holdout)
        m.HOLDOUT_USERS.labels("champion").set(got.users_champion)
        metrics = holdout.step_metrics(got.effects)
        if metrics:
            self.record(h.id, now, metrics)
        return rep

    def close(self) -> None:
        if self.tail is not None:
            self.tail.close()


def read_holdout_report(client: Any, prefix: str) -> dict[str, Any] | None:
    """The latest champion-vs-holdout measurement (:class:`HoldoutMonitor` writes it), or None."""
    return read_json(client, holdout_report_key(prefix))
