"""Shared fixtures. Tiers follow the folder: tests/unit (no network), tests/integration
(real broker, Redis, MLflow, Ray), tests/e2e (the loop in separate processes),
tests/reliability (faults, load and bad input on real processes; bounded unless
RTRL_RELIABILITY_SCALE=soak, see scripts/reliability).

Integration fixtures start real components on free loopback ports in a temporary folder,
once per test session, and stop them at the end: a test never depends on a service the
machine happens to run.
"""

from __future__ import annotations

import itertools
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from services.settings.model import KafkaSettings, MlflowSettings, RedisSettings, Settings, TopicSettings

if TYPE_CHECKING:
    from services.stack.embedded import EmbeddedStack

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")

_TIERS = ("e2e", "reliability", "integration", "unit")
"""In the order a parallel run starts them: the longest first, so the workers end together."""


def _tier(item: pytest.Item) -> str | None:
    parts = Path(str(item.fspath)).parts
    return next((tier for tier in _TIERS if tier in parts), None)


def work_group(tier: str | None, module: str, fixtures: list[str]) -> str:
    """The unit of work one parallel worker takes whole (``--dist loadgroup``): a test module,
    so its module fixtures start once; the e2e tier is one unit, because each of its tests runs
    a whole loop, and two at a time on a 2-core machine would starve both; and the modules on
    the session's vLLM engine are one, so only one worker starts an engine."""
    if tier == "e2e":
        return "e2e"
    return "vllm-engine" if "vllm_engine" in fixtures else module


def run_order(tier: str | None) -> int:
    return _TIERS.index(tier) if tier in _TIERS else len(_TIERS)


@pytest.hookimpl(tryfirst=True)  # before xdist names each test after its group
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tier = _tier(item)
        if tier:
            item.add_marker(getattr(pytest.mark, tier))
    if config.getoption("dist", "no") == "loadgroup":
        for item in items:
            fixtures = list(getattr(item, "fixturenames", []))
            group = work_group(_tier(item), item.nodeid.split("::")[0], fixtures)
            item.add_marker(pytest.mark.xdist_group(group))
        items.sort(key=lambda item: run_order(_tier(item)))  # stable: a module's order is kept


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A real Kafka-protocol broker and Redis on free ports (no MLflow server)."""
    from services.stack.embedded import EmbeddedStack, free_port

    st = EmbeddedStack(
        data_dir=tmp_path_factory.mktemp("stack"),
        kafka_port=free_port(),
        redis_port=free_port(),
        reuse_redis_url=None,
        with_mlflow=False,
    )
    st.up(timeout_s=60)
    yield st
    st.down()


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real MLflow tracking server (sqlite backend) on a free port; yields its URI."""
    from services.stack.embedded import EmbeddedStack, free_port

    st = EmbeddedStack(
        data_dir=tmp_path_factory.mktemp("mlflow"),
        kafka_port=free_port(),
        redis_port=free_port(),
        mlflow_port=free_port(),
        with_mlflow=True,
    )
    st.data_dir.mkdir(parents=True, exist_ok=True)
    st._up_mlflow()
    import time

    deadline = time.monotonic() + 120
    while not st.mlflow_answers():
        assert time.monotonic() < deadline, "MLflow server did not start"
        time.sleep(0.5)
    yield st.mlflow_uri
    st.down()


_topic_seq = itertools.count()


@pytest.fixture
def settings(stack: object) -> Settings:
    """Settings pointing at the session's broker and Redis, with topics and Redis keys
    unique to this test so tests never see each other's data."""
    from services.stack.embedded import EmbeddedStack

    assert isinstance(stack, EmbeddedStack)
    tag = f"t{next(_topic_seq)}-{uuid.uuid4().hex[:6]}"
    return Settings(
        kafka=KafkaSettings(bootstrap_servers=stack.kafka_bootstrap),
        redis=RedisSettings(url=stack.redis_url, key_prefix=f"{tag}:"),  # type: ignore[arg-type]
        topics=TopicSettings(
            raw=f"{tag}.raw", events=f"{tag}.events", rewards=f"{tag}.rewards", dlq=f"{tag}.dlq",
            sessions=f"{tag}.sessions", partitions=4,
        ),
        mlflow=MlflowSettings(tracking_uri="sqlite:///unused.db"),
    )


@pytest.fixture
def isolated_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmbeddedStack, Settings]]:
    """A broker and Redis of this test's own (an ``EmbeddedStack``) and settings on them. For
    tests that SIGKILL workers: noida-db keeps a killed group member and its open transaction
    for good, which must not leak into the tests that share the session broker."""
    from services.stack.embedded import EmbeddedStack, free_port

    st = EmbeddedStack(data_dir=tmp_path_factory.mktemp("isolated"), kafka_port=free_port(),
                       redis_port=free_port(), reuse_redis_url=None, with_mlflow=False)
    st.up(timeout_s=60)
    tag = f"i{next(_topic_seq)}"
    try:
        yield st, Settings(
            kafka=KafkaSettings(bootstrap_servers=st.kafka_bootstrap),
            redis=RedisSettings(url=st.redis_url, key_prefix=f"{tag}:"),  # type: ignore[arg-type]
            topics=TopicSettings(raw=f"{tag}.raw", events=f"{tag}.events", rewards=f"{tag}.rewards",
                                 dlq=f"{tag}.dlq", sessions=f"{tag}.sessions", partitions=4),
            mlflow=MlflowSettings(tracking_uri="sqlite:///unused.db"),
        )
    finally:
        st.down()


@pytest.fixture
def isolated_settings(isolated_stack: tuple[EmbeddedStack, Settings]) -> Settings:
    """Settings on a broker and Redis of this test's own (see ``isolated_stack``)."""
    return isolated_stack[1]
