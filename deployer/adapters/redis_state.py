"""The controller's Redis state: routing keys the gateway reads, the persisted canary status,
the controller lease and the operator command queue. Keys (``p`` = ``key_prefix``)::

    {p}routing:canary_weight | salt | stable_version | canary_version   (gateway reads)
    {p}routing:holdout     JSON of the long-term holdout (deployer/holdout.py; gateway reads)
    {p}deployer:status     JSON CanaryStatus, written after every tick
    {p}deployer:lease      owner id of the one controller allowed to act (expires)
    {p}deployer:commands   list of JSON operator commands, oldest first
    {p}deployer:executed:<id>  ids of accepted operator commands (expire): replays are refused
    {p}deployer:wake       hash: a counter writers bump so the controller ticks at once
    {p}registry:candidate-lock  held while a writer checks and moves the candidate alias
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any, cast

import redis
from ingest.contracts import keys
from ingest.contracts.keys import routing_keys

from deployer.registry import LockUnavailableError
from deployer.routing import Holdout
from deployer.status import CanaryStatus, Command

log = logging.getLogger(__name__)

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2]) return 1
end
return 0
"""
_SAVE_IF_OWNER = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] or not holder then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
  redis.call('SET', KEYS[2], ARGV[2]) return 1
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class RedisRouting:
    """:class:`deployer.actions.RoutingPort`: the routing table under ``{prefix}routing:``."""

    def __init__(self, client: redis.Redis, prefix: str) -> None:
        self.r, self.keys = client, routing_keys(prefix)

    def set_routing(self, stable: str | None, canary: str | None, weight: float, salt: str) -> None:
        pipe = self.r.pipeline(transaction=True)
        k = self.keys
        # MULTI/EXEC: the gateway never reads a canary version with another canary's weight.
        pipe.set(k["canary_weight"], repr(float(weight)))
        pipe.set(k["salt"], salt)
        for key, version in ((k["stable_version"], stable), (k["canary_version"], canary)):
            if version:
                pipe.set(key, version)
            else:
                pipe.delete(key)
        pipe.execute()

    def set_weight(self, weight: float) -> None:
        self.r.set(self.keys["canary_weight"], repr(float(weight)))

    def set_holdout(self, holdout: Holdout | None) -> None:
        if holdout is None:
            self.r.delete(self.keys["holdout"])
        else:
            self.r.set(self.keys["holdout"], holdout.to_text())

    def read(self) -> dict[str, str | None]:
        values = self.r.mget(list(self.keys.values()))
        return {name: (v.decode() if isinstance(v, bytes) else v)
                for name, v in zip(self.keys, values, strict=True)}


class ControllerState:
    """Status, lease and command queue of the canary controller."""

    def __init__(self, client: redis.Redis, prefix: str, owner: str | None = None) -> None:
        self.r = client
        self.status_key = keys.deployer_status_key(prefix)
        self.lease_key = keys.deployer_lease_key(prefix)
        self.commands_key = keys.deployer_commands_key(prefix)
        self.executed_key = keys.deployer_executed_key(prefix)
        self.owner = owner or f"controller-{uuid.uuid4().hex[:12]}"
        self.ttl_ms = 60_000

    # ---------------------------------------------------------------- status
    def load(self) -> CanaryStatus:
        raw = self.r.get(self.status_key)
        if raw is None:
            return CanaryStatus()
        return CanaryStatus.from_json(json.loads(raw))

    def save(self, status: CanaryStatus) -> None:
        """Persist ``status`` and renew the lease, only while no other controller holds the
        lease (fencing: a controller that lost its lease never overwrites its successor's
        status; one whose lease lapsed during a slow tick, unclaimed, keeps it)."""
        ok = self.r.eval(_SAVE_IF_OWNER, 2, self.lease_key, self.status_key, self.owner,
                         json.dumps(status.to_json()), self.ttl_ms)
        if not ok:
            raise LeaseLostError(f"{self.owner} no longer holds {self.lease_key}; status not saved")

    # ---------------------------------------------------------------- lease
    def acquire(self, ttl_s: float) -> bool:
        """Take the lease if free, or renew it if ours. At most one controller acts."""
        self.ttl_ms = ttl_ms = max(1, int(ttl_s * 1000))
        if self.r.set(self.lease_key, self.owner, nx=True, px=ttl_ms):
            return True
        return bool(self.r.eval(_RENEW, 1, self.lease_key, self.owner, ttl_ms))

    def release(self) -> None:
        self.r.eval(_RELEASE, 1, self.lease_key, self.owner)

    def holder(self) -> str | None:
        raw = self.r.get(self.lease_key)
        return raw.decode() if isinstance(raw, bytes) else raw

    # ---------------------------------------------------------------- commands
    def push(self, command: Command) -> None:
        self.r.rpush(self.commands_key, json.dumps(command.__dict__))

    def pending(self) -> tuple[Command, ...]:
        """The queued commands, oldest first. An entry that is no command (not JSON, no id or
        kind) is dropped from the queue with a warning, so it cannot block the ones behind it;
        fields this version does not know are ignored."""
        out = []
        for raw in self.r.lrange(self.commands_key, 0, -1):
            try:
                data = json.loads(raw)
                out.append(Command(**{k: v for k, v in data.items() if k in Command.__dataclass_fields__}))
            except (ValueError, TypeError, AttributeError) as exc:
                log.warning("dropping a queued operator command that is not one (%s): %.200r", exc, raw)
                self.r.lrem(self.commands_key, 1, cast(str, raw))
        return tuple(out)

    def seen(self, ids: list[str]) -> set[str]:
        """Which of these command ids were accepted before (deployer/operators.py)."""
        if not ids:
            return set()
        found = self.r.mget([f"{self.executed_key}{i}" for i in ids])
        return {i for i, v in zip(ids, found, strict=True) if v is not None}

    def remember(self, ids: list[str], ttl_s: float) -> None:
        """Record accepted command ids for ``ttl_s`` (longer than a signature stays valid)."""
        ttl_ms = max(1, int(ttl_s * 1000))
        for i in ids:
            self.r.set(f"{self.executed_key}{i}", "1", px=ttl_ms)

    def trim(self, handled_ids: set[str]) -> None:
        """Drop handled commands (called after the status recording them was saved)."""
        for raw in self.r.lrange(self.commands_key, 0, -1):
            data: dict[str, Any] = json.loads(raw)
            if data.get("id") in handled_ids:
                self.r.lrem(self.commands_key, 1, cast(str, raw))  # bytes work; stubs say str


class LeaseLostError(RuntimeError):
    """Another controller holds the lease."""


class RedisLock:
    """A short mutual-exclusion lock in Redis (``SET NX PX`` with an owner token, released
    only by its owner). Reusable: each ``with`` takes it anew. Serialises the writers of the
    ``candidate`` alias (:func:`deployer.registry.offer_candidate`); the expiry bounds how long
    a writer that died holding it blocks the others."""

    def __init__(self, client: redis.Redis, key: str, ttl_s: float = 30.0, wait_s: float = 60.0) -> None:
        self.r, self.key, self.ttl_ms, self.wait_s = client, key, max(1, int(ttl_s * 1000)), wait_s
        self._token: str | None = None

    def __enter__(self) -> RedisLock:
        token, deadline, pause = uuid.uuid4().hex, time.monotonic() + self.wait_s, 0.01
        try:
            while not self.r.set(self.key, token, nx=True, px=self.ttl_ms):
                if time.monotonic() > deadline:
                    raise LockUnavailableError(f"{self.key} held by another writer for over {self.wait_s:g}s")
                time.sleep(pause)
                pause = min(0.5, pause * 2)
        except redis.RedisError as exc:
            why = f"{type(exc).__name__}: {exc}"
            raise LockUnavailableError(f"{self.key}: Redis unavailable ({why})") from exc
        self._token = token
        return self

    def __exit__(self, *exc: object) -> None:
        token, self._token = self._token, None
        if token is not None:
            self.r.eval(_RELEASE, 1, self.key, token)


def candidate_lock(client: redis.Redis, prefix: str) -> RedisLock:
    """The lock every writer of the ``candidate`` alias holds while it checks and moves it."""
    return RedisLock(client, keys.candidate_lock_key(prefix))


# ---------------------------------------------------------------------------- waking the deployer
def wake_deployer(client: redis.Redis, prefix: str, reason: str) -> None:
    """Ask every deployer replica to tick now (a new candidate, an operator command): bumps the
    ``deployer:wake`` counter. Best effort: a deployer that misses it ticks on its schedule."""
    key = keys.deployer_wake_key(prefix)
    try:
        pipe = client.pipeline()
        pipe.hincrby(key, "n", 1)
        pipe.hset(key, "reason", reason[:200])
        pipe.execute()
    except redis.RedisError as exc:
        log.warning("could not wake the deployer (%s: %s); it ticks on its schedule", type(exc).__name__, exc)


class Wakeup:
    """The controller's wait between ticks: ``tick_s`` at most, cut short when a writer bumps
    ``deployer:wake`` (read every ``poll_s``; one small HGETALL, so each replica sees every
    bump) or an operator command is queued."""

    def __init__(self, client: redis.Redis, prefix: str, poll_s: float = 1.0) -> None:
        self.client = client
        self.key = keys.deployer_wake_key(prefix)
        self.commands = keys.deployer_commands_key(prefix)
        self.poll_s = poll_s
        self.seen: bytes | None = self._count()

    def _count(self) -> bytes | None:
        try:
            return cast(bytes | None, self.client.hget(self.key, "n"))
        except redis.RedisError:
            return None

    def wait(self, tick_s: float, sleep: Callable[[float], bool]) -> str | None:
        """Sleep (``sleep`` returns True when the process is stopping) until ``tick_s`` has
        passed or a wake-up came; the wake-up's reason, or None."""
        deadline = time.monotonic() + tick_s
        while (left := deadline - time.monotonic()) > 0:
            if sleep(min(self.poll_s, left)):
                return None
            try:
                pipe = self.client.pipeline()
                pipe.hgetall(self.key)
                pipe.llen(self.commands)
                doc, queued = pipe.execute()
            except redis.RedisError:  # Redis is down: the tick will say so; keep the schedule
                continue
            n = doc.get(b"n")
            if n is not None and n != self.seen:
                self.seen = n
                return (doc.get(b"reason") or b"wake-up").decode(errors="replace")
            if queued:
                return "operator command"
        return None
