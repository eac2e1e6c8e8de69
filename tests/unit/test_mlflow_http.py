"""The MLflow client bounds shared by the services and the CLI, and the attribution of a failed
deployer tick to the dependency that caused it."""

from __future__ import annotations

import kafka.errors
import pytest
import redis
import requests
from mlflow.exceptions import MlflowException

from services.runtime.mlflow_http import RETRIES_VAR, TIMEOUT_VAR, bound_mlflow_client, dependency_of


def test_bounds_are_set_only_where_the_environment_is_silent() -> None:
    env: dict[str, str] = {}
    assert bound_mlflow_client(20, 2, env) == {TIMEOUT_VAR: "20", RETRIES_VAR: "2"}
    env = {TIMEOUT_VAR: "5"}
    assert bound_mlflow_client(20, 2, env) == {TIMEOUT_VAR: "5", RETRIES_VAR: "2"}
    assert env == {TIMEOUT_VAR: "5", RETRIES_VAR: "2"}


@pytest.mark.parametrize(("exc", "dep"), [
    (MlflowException("registry down"), "mlflow"),
    (requests.ConnectionError("refused"), "mlflow"),
    (redis.ConnectionError("refused"), "redis"),
    (redis.exceptions.BusyLoadingError("loading"), "redis"),
    (kafka.errors.KafkaTimeoutError("no broker"), "kafka"),
    (ValueError("a bug"), None),
    (KeyError("a bug"), None),
])
def test_a_tick_failure_is_attributed_by_the_exception_class(exc: BaseException, dep: str | None) -> None:
    assert dependency_of(exc) == dep


def test_a_wrapped_failure_is_attributed_to_its_cause() -> None:
    try:
        try:
            raise redis.TimeoutError("slow")
        except redis.TimeoutError as inner:
            raise RuntimeError("tick") from inner
    except RuntimeError as outer:
        assert dependency_of(outer) == "redis"
    loop = ValueError("self-referencing")
    loop.__context__ = loop
    assert dependency_of(loop) is None
