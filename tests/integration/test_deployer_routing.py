"""The routing contract (tests/unit/test_canary_routing_contract.py) against real Redis."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from deployer.adapters.redis_state import RedisRouting
from services.runtime.redis_io import make_redis
from services.settings.model import Settings

_spec = importlib.util.spec_from_file_location(
    "canary_routing_contract", Path(__file__).parents[1] / "unit" / "test_canary_routing_contract.py"
)
assert _spec and _spec.loader
contract = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(contract)


class TestRedisRouting(contract.RoutingContract):  # type: ignore[name-defined,misc]
    @pytest.fixture
    def routing(self, settings: Settings) -> RedisRouting:
        return RedisRouting(make_redis(settings.redis), settings.redis.key_prefix)
