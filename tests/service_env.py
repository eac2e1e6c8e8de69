"""The environment of an ``rtrl serve …`` child process pointed at a test's stack."""

from __future__ import annotations

import os
from pathlib import Path

from services.settings.model import Settings


def service_env(settings: Settings, stack_dir: Path, **extra: str) -> dict[str, str]:
    """The caller's environment without any ``RTRL_*``, plus the broker, Redis (with its key
    prefix) and topics of ``settings``; ``stack_dir`` is the child's ``RTRL_STACK__DATA_DIR``
    (a directory without a stack.env, so it never reads a developer's stack). ``extra``
    comes last and wins."""
    t = settings.topics
    env = {k: v for k, v in os.environ.items() if not k.startswith("RTRL_")}
    env.update({
        "RTRL_STACK__DATA_DIR": str(stack_dir),
        "RTRL_KAFKA__BOOTSTRAP_SERVERS": settings.kafka.bootstrap_servers,
        "RTRL_REDIS__URL": settings.redis.url.get_secret_value(),
        "RTRL_REDIS__KEY_PREFIX": settings.redis.key_prefix,
        "RTRL_TOPICS__RAW": t.raw, "RTRL_TOPICS__EVENTS": t.events,
        "RTRL_TOPICS__REWARDS": t.rewards, "RTRL_TOPICS__DLQ": t.dlq,
        "RTRL_TOPICS__SESSIONS": t.sessions,
        "RTRL_TOPICS__PARTITIONS": str(t.partitions),
        "RTRL_LOG_LEVEL": "INFO",
    })
    env.update(extra)
    return env
