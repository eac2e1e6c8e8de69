"""Each process serves only its own metrics and the shared ones (ingest/contracts/prometheus.py):
another service's gauges at their initial 0 made alerts fire on every process."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.registry import Collector

from ingest.contracts import prometheus as m

pytestmark = pytest.mark.unit


def _catalogue() -> dict[str, Collector]:
    return {name: obj for name, obj in vars(m).items()
            if name.isupper() and hasattr(obj, "collect") and hasattr(obj, "_name")}


def _names(registry: object) -> set[str]:
    return {family.name for family in registry.collect()}  # type: ignore[attr-defined]


def test_every_catalogued_metric_has_exactly_one_owner_or_is_shared() -> None:
    owned = [id(c) for cs in m.OWNERS.values() for c in cs] + [id(c) for c in m.SHARED]
    for name, collector in _catalogue().items():
        assert owned.count(id(collector)) == 1, f"{name} must be in SHARED or in one OWNERS entry"
    assert len(owned) == len(_catalogue())


@pytest.mark.parametrize("service", sorted(m.OWNERS))
def test_a_service_exports_its_own_and_the_shared_metrics_only(service: str) -> None:
    names = _names(m.registry_for(service))
    assert {"rtrl_build", "rtrl_consumer_lag_messages", "process_start_time_seconds"} <= names
    assert {c._name for c in m.OWNERS[service]} <= names  # type: ignore[attr-defined]
    for other, collectors in m.OWNERS.items():
        if other != service:
            leaked = names & {c._name for c in collectors}  # type: ignore[attr-defined]
            assert not leaked, f"{service} would export {other}'s {sorted(leaked)}"


def test_only_the_trainer_exports_the_trainers_gauges() -> None:
    for service in m.OWNERS:
        text = generate_latest(m.registry_for(service)).decode()
        assert ("rtrl_trainer_cadence_seconds " in text) == (service == "trainer"), service
    assert "rtrl_trainer_cadence_seconds" in _names(REGISTRY)  # the catalogue itself keeps all


def test_updates_through_the_catalogue_show_in_the_service_registry() -> None:
    registry = m.registry_for("deployer")
    m.CANARY_WEIGHT.set(0.25)
    assert registry.get_sample_value("rtrl_canary_weight") == 0.25


def test_a_process_running_two_services_exports_both() -> None:
    names = _names(m.registry_for("gateway", "simulator", "gateway"))
    assert {"rtrl_gateway_requests", "rtrl_sim_requests"} <= names


def test_an_unknown_service_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"unknown service.*'rewards'.*known"):
        m.registry_for("rewards")


@pytest.mark.parametrize("values", [[0.5, -1.25, 0.0, 2.0, -0.5], [-1.0, -2.0], [0.0], [3.5]])
def test_the_mean_reward_is_recoverable_from_the_exported_series(values: list[float]) -> None:
    arm = f"probe-{len(values)}-{values[0]}"
    registry = m.registry_for("reward")
    for v in values:
        m.observe_reward(arm, v)
    pos = registry.get_sample_value("rtrl_reward_value_positive_total", {"arm": arm}) or 0.0
    neg = registry.get_sample_value("rtrl_reward_value_negative_total", {"arm": arm}) or 0.0
    count = registry.get_sample_value("rtrl_reward_value_count", {"arm": arm})
    assert count == len(values)
    assert (pos - neg) / count == pytest.approx(sum(values) / len(values))
