"""The routing port's contract, run against the in-memory fake here and against Redis in
tests/integration/test_deployer_routing.py: what the deployer writes is what the gateway's
parser (deployer/routing.parse_table) reads."""

from __future__ import annotations

import pytest

from deployer.adapters.memory import FakeRouting
from deployer.routing import Holdout, parse_table


class RoutingContract:
    @pytest.fixture
    def routing(self) -> object:
        raise NotImplementedError

    def test_a_canary_is_read_back_by_the_gateway_parser(self, routing: FakeRouting) -> None:
        routing.set_routing("1", "2", 0.0, "canary-v2-x")
        routing.set_weight(0.05)
        table = parse_table(routing.read())
        assert (table.stable_version, table.canary_version, table.salt) == ("1", "2", "canary-v2-x")
        assert table.canary_weight == 0.05 and not table.problems

    def test_ending_a_canary_removes_the_canary_version(self, routing: FakeRouting) -> None:
        routing.set_routing("1", "2", 0.25, "s1")
        routing.set_routing("2", None, 0.0, "s1")
        table = parse_table(routing.read())
        assert table.canary_version is None and table.stable_version == "2" and table.canary_weight == 0.0
        assert table.arm_for("any-user", canary_available=True) == "stable"

    def test_writes_are_idempotent(self, routing: FakeRouting) -> None:
        for _ in range(2):
            routing.set_routing("1", "2", 0.5, "s")
            routing.set_weight(0.5)
        assert routing.read() == {"canary_weight": "0.5", "salt": "s", "stable_version": "1",
                                  "canary_version": "2", "holdout": None}

    def test_a_holdout_is_read_back_and_left_alone_by_canary_writes(self, routing: FakeRouting) -> None:
        h = Holdout(id="holdout-v1-abc", version="1", share=0.1, salt="holdout-s", started_at=100.0,
                    until=200.0, by="alice")
        routing.set_holdout(h)
        routing.set_routing("1", "2", 0.25, "s1")
        routing.set_weight(0.5)
        table = parse_table(routing.read())
        assert table.holdout == h and not table.problems
        routing.set_holdout(None)
        assert parse_table(routing.read()).holdout is None
        assert routing.read()["canary_version"] == "2"


class TestFakeRouting(RoutingContract):
    @pytest.fixture
    def routing(self) -> FakeRouting:
        return FakeRouting()
