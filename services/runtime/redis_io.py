"""Redis adapter factory. Only adapters and services import redis."""

from __future__ import annotations

import time

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from services.settings.model import RedisSettings


def make_redis(settings: RedisSettings, timeout_s: float | None = None) -> redis.Redis:
    """A client for the services: long timeouts and redis-py's retries, since a worker rides out
    a Redis restart. With ``timeout_s`` (the ``rtrl`` operator commands): each call waits at most
    ``timeout_s`` to connect and ``timeout_s`` for the answer, and is not retried."""
    if timeout_s is not None:
        return redis.Redis.from_url(settings.url.get_secret_value(), socket_timeout=timeout_s,
                                    socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0))
    return redis.Redis.from_url(
        settings.url.get_secret_value(),
        socket_timeout=10,
        socket_connect_timeout=5,
        health_check_interval=15,
        retry_on_timeout=True,
    )


def redis_answers(url: str, timeout_s: float = 0.5) -> bool:
    """True when a Redis at ``url`` answers PING."""
    try:
        client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (redis.RedisError, OSError, ValueError):
        return False


def wait_for_redis(url: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if redis_answers(url):
            return
        time.sleep(0.05)
    raise TimeoutError(f"Redis at {url.split('@')[-1]} did not answer in {timeout_s}s")
