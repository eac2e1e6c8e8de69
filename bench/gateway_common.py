"""What the gateway benchmarks share: percentiles, a gateway on a private stack, its settings."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from services.gateway.asgi.app import GatewayServer
from services.runtime.health import Health
from services.runtime.kafka_io import ensure_topics
from services.settings.model import KafkaSettings, MlflowSettings, RedisSettings, Settings, TopicSettings
from services.settings.services import GatewaySettings
from services.stack.embedded import EmbeddedStack
from services.wiring.gateway import build


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]): the smallest value with at least q% of the
    values at or below it."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]


def bench_settings(stack: EmbeddedStack, root: Path, tag: str, **gateway: Any) -> Settings:
    return Settings(
        kafka=KafkaSettings(bootstrap_servers=stack.kafka_bootstrap),
        redis=RedisSettings(url=SecretStr(stack.redis_url), key_prefix=f"bench-{tag}:"),
        topics=TopicSettings(raw=f"bench-{tag}.raw", partitions=1),
        mlflow=MlflowSettings(tracking_uri=f"sqlite:///{root / 'mlflow.db'}",
                              registered_model="bench-policy"),
        gateway=GatewaySettings(**{"port": 0, "allow_anonymous": True, "key_id": "gateway",
                                   "secret": SecretStr("bench"), "spool_dir": root / f"spool-{tag}",
                                   **gateway}),
    )


def start_gateway(settings: Settings) -> tuple[Any, Any, list[Any]]:
    ensure_topics(settings, [settings.topics.raw])
    gateway, parts = build(settings, Health())
    server = GatewayServer(gateway, "127.0.0.1", 0).start()
    deadline = time.monotonic() + 60
    while gateway.slots.get("stable") is None or (
        gateway.slots.wanted("canary") and gateway.slots.get("canary") is None
    ):
        if time.monotonic() > deadline:
            stop_gateway(server, parts)  # its threads and exposure process must not outlive it
            raise RuntimeError("gateway did not load its models in 60 s")
        time.sleep(0.05)
    return gateway, server, parts


def stop_gateway(server: Any, parts: list[Any]) -> None:
    server.stop()
    for part in parts:
        part.stop()
