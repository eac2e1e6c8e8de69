"""The lock that serialises writers of the candidate alias, on real Redis: two writers racing
to offer candidates never both win, and an unreachable Redis is a clear error, not a move."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from deployer.adapters.memory import InMemoryRegistry
from deployer.adapters.redis_state import RedisLock, candidate_lock
from deployer.registry import LockUnavailableError, Registry, offer_candidate
from ingest.contracts.registry import CANDIDATE
from services.runtime.redis_io import make_redis
from services.settings.model import RedisSettings, Settings


class SlowRegistry(InMemoryRegistry):
    """Widens the check-then-set window so that an unserialised race would be lost."""

    def alias_version(self, alias: str) -> str | None:
        got = super().alias_version(alias)
        time.sleep(0.05)
        return got


def _version(reg: Registry, root: Path, name: str) -> str:
    d = root / name
    d.mkdir(parents=True)
    (d / "policy.json").write_text("{}")
    return reg.register(None, d, {})


def test_racing_writers_offer_exactly_one_candidate(settings: Settings, tmp_path: Path) -> None:
    r = make_redis(settings.redis)
    reg = SlowRegistry(tmp_path / "reg")
    versions = [_version(reg, tmp_path, f"p{i}") for i in range(6)]
    results: dict[str, str | None] = {}
    start = threading.Barrier(len(versions))

    def writer(v: str) -> None:
        start.wait()
        results[v] = offer_candidate(reg, v, candidate_lock(r, settings.redis.key_prefix))

    threads = [threading.Thread(target=writer, args=(v,)) for v in versions]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    winners = [v for v, held in results.items() if held is None]
    assert len(winners) == 1, results
    assert reg.alias_version(CANDIDATE) == winners[0]
    assert all(held == winners[0] for v, held in results.items() if v != winners[0])
    assert r.get(f"{settings.redis.key_prefix}registry:candidate-lock") is None, "lock released"


def test_lock_held_too_long_and_unreachable_redis_are_clear_errors(settings: Settings) -> None:
    r = make_redis(settings.redis)
    key = f"{settings.redis.key_prefix}registry:candidate-lock"
    with RedisLock(r, key, ttl_s=5):
        with pytest.raises(LockUnavailableError, match="held by another writer"):
            with RedisLock(r, key, wait_s=0.3):
                pass
    with RedisLock(r, key, wait_s=0.3):
        pass  # free again once released

    dead = make_redis(RedisSettings(url="redis://127.0.0.1:1/0"))  # type: ignore[arg-type]
    with pytest.raises(LockUnavailableError, match="Redis unavailable"):
        with RedisLock(dead, key, wait_s=0.3):
            pass
