"""Redis adapter for ingest's dedup store (ingest/dedup.py)."""

from __future__ import annotations

from collections.abc import Sequence

import redis

from ingest.contracts.keys import dedup_prefix

# For each key: SET NX EX; reply "" when this call stored its marker, else the marker that
# holds the key. "" is never a marker (markers are "topic:partition:offset"), and unlike
# Lua's false it cannot truncate the reply array.
_CLAIM_SCRIPT = """
local ttl = ARGV[1]
local out = {}
for i, key in ipairs(KEYS) do
  if redis.call('SET', key, ARGV[i + 1], 'NX', 'EX', ttl) then
    out[i] = ''
  else
    out[i] = redis.call('GET', key) or ''
  end
end
return out
"""


class RedisDedupStore:
    """DedupStore on Redis: ``SET <prefix>ingest:dedup:<event_id> <marker> NX EX <ttl>``.

    One round trip per batch: a server-side script claims every id of the batch and
    returns, per id, the marker that already held it (or nothing when this call claimed
    it). A Redis Cluster cannot run one script over keys in different slots; there the
    adapter falls back to a MULTI/EXEC pipeline of ``SET NX`` + ``GET`` per id, which gives
    the same answers at a higher per-event cost.
    """

    def __init__(self, client: redis.Redis, key_prefix: str, ttl_s: int) -> None:
        if ttl_s <= 0:
            raise ValueError(f"dedup TTL must be positive, got {ttl_s}")
        self._r = client
        self._prefix = dedup_prefix(key_prefix)
        self.ttl_s = ttl_s
        self._script = client.register_script(_CLAIM_SCRIPT)
        self._scripted = True

    def key(self, event_id: str) -> str:
        return self._prefix + event_id

    def claim_many(self, claims: Sequence[tuple[str, str]]) -> list[str | None]:
        if not claims:
            return []
        if self._scripted:
            try:
                return self._claim_scripted(claims)
            except redis.ResponseError as exc:
                if "CROSSSLOT" not in str(exc).upper():
                    raise
                self._scripted = False  # a cluster: keys of one batch span slots
        return self._claim_pipelined(claims)

    def _claim_scripted(self, claims: Sequence[tuple[str, str]]) -> list[str | None]:
        keys = [self._prefix + event_id for event_id, _ in claims]
        replies = self._script(keys=keys, args=[self.ttl_s, *(m for _, m in claims)])
        return [_held(r) for r in replies]

    def _claim_pipelined(self, claims: Sequence[tuple[str, str]]) -> list[str | None]:
        pipe = self._r.pipeline(transaction=True)
        for event_id, marker in claims:
            k = self.key(event_id)
            pipe.set(k, marker, nx=True, ex=self.ttl_s)
            pipe.get(k)
        replies = pipe.execute()
        return [None if replies[2 * i] else _held(replies[2 * i + 1]) for i in range(len(claims))]

    def forget(self, event_id: str) -> None:
        self._r.delete(self.key(event_id))


def _held(reply: bytes | str | None) -> str | None:
    """The marker in a reply, or None when the claim was ours (empty reply)."""
    if reply is None:
        return None
    held = reply.decode() if isinstance(reply, bytes) else reply
    return held or None
