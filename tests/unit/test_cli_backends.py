"""How the ``rtrl`` operator commands bound their calls and recognise a backend that is down:
on the clients' real exception objects, without any network."""

from __future__ import annotations

import argparse

import pytest
import redis
import requests
from kafka.errors import KafkaConnectionError, KafkaTimeoutError, UnknownTopicOrPartitionError
from mlflow.exceptions import MlflowException

from services.cli import exit_codes
from services.cli.backends import (
    Failure,
    backend_failure,
    bound_mlflow_env,
    bounded_settings,
    message,
)
from services.runtime.flags import deprecated_alias
from services.runtime.redis_io import make_redis
from services.settings.model import Settings, settings_from_env


def _mlflow_error(cause: Exception) -> MlflowException:
    """As mlflow/utils/rest_utils.py raises it: inside ``except``, without ``from``."""
    try:
        raise cause
    except Exception as e:
        try:
            raise MlflowException(f"API request to http://x/api failed with exception {e}")
        except MlflowException as wrapped:
            return wrapped


def test_mlflow_connection_refused_and_timeout_are_recognised() -> None:
    refused = requests.exceptions.ConnectionError("Failed to establish a new connection: [Errno 111] "
                                                  "Connection refused")
    assert backend_failure(_mlflow_error(refused)) == Failure("mlflow", refused=True)
    assert backend_failure(_mlflow_error(requests.exceptions.ReadTimeout("read timed out"))) == \
        Failure("mlflow", refused=False)


def test_redis_and_kafka_errors_are_recognised() -> None:
    assert backend_failure(redis.ConnectionError("Error 111 connecting. Connection refused.")) == \
        Failure("redis", refused=True)
    assert backend_failure(redis.TimeoutError("Timeout reading from socket")) == \
        Failure("redis", refused=False)
    assert backend_failure(KafkaTimeoutError("Unable to bootstrap from ['127.0.0.1:1']")) == \
        Failure("kafka", refused=False)
    assert backend_failure(KafkaConnectionError("socket disconnected")) == Failure("kafka", refused=False)


@pytest.mark.parametrize("exc", [
    MlflowException("Registered Model with name=x not found", error_code="RESOURCE_DOES_NOT_EXIST"),
    redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"),
    UnknownTopicOrPartitionError(),
    ValueError("a bug"),
    ConnectionRefusedError("not from a backend client"),
])
def test_other_errors_are_not_hidden_as_unavailable(exc: Exception) -> None:
    assert backend_failure(exc) is None


def test_message_names_backend_address_and_setting_without_credentials() -> None:
    s = settings_from_env({"RTRL_REDIS__URL": "redis://:hunter2@10.0.0.5:6379/0",
                           "RTRL_MLFLOW__TRACKING_URI": "http://127.0.0.1:5999"})
    line = message("status", Failure("redis", refused=False), s, 3)
    assert line == ("rtrl status: Redis at redis://10.0.0.5:6379/0 did not answer within 3s "
                    "(set RTRL_REDIS__URL)")
    assert message("history", Failure("mlflow", refused=True), s, 3) == (
        "rtrl history: MLflow at http://127.0.0.1:5999 refused the connection "
        "(set RTRL_MLFLOW__TRACKING_URI)")
    assert message("train", Failure("kafka", refused=False), s, None).endswith(
        "Kafka at 127.0.0.1:9092 did not answer (set RTRL_KAFKA__BOOTSTRAP_SERVERS)")


def test_mlflow_env_is_bounded_unless_the_operator_set_it() -> None:
    env: dict[str, str] = {}
    assert bound_mlflow_env(3, env) == 3.0
    assert env == {"MLFLOW_HTTP_REQUEST_TIMEOUT": "3", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}
    env = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}
    assert bound_mlflow_env(3, env) == 30.0 and env["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "0"


def test_kafka_and_redis_clients_are_bounded() -> None:
    s = bounded_settings(settings_from_env({"RTRL_CLI__TIMEOUT_S": "2"}))
    kw = s.kafka.client_kwargs()
    assert kw["request_timeout_ms"] == 2000 and kw["bootstrap_timeout_ms"] == 2000
    assert Settings().kafka.client_kwargs()["bootstrap_timeout_ms"] == 30_000  # services keep theirs
    client = make_redis(s.redis, s.cli.timeout_s)
    conn = client.connection_pool.connection_kwargs
    assert conn["socket_timeout"] == 2 and conn["socket_connect_timeout"] == 2
    assert client.get_retry() is not None and client.get_retry().get_retries() == 0  # type: ignore[union-attr]


def test_deprecated_alias_still_works_and_says_the_new_name(capsys: pytest.CaptureFixture[str]) -> None:
    ap = argparse.ArgumentParser(prog="rtrl serve x")
    ap.add_argument("--port", type=int, default=None)
    deprecated_alias(ap, "--metrics-port", "--port")
    assert ap.parse_args(["--metrics-port", "9100"]).port == 9100
    assert capsys.readouterr().err.strip() == "rtrl serve x: --metrics-port is deprecated, use --port"
    assert ap.parse_args(["--port", "9101"]).port == 9101 and capsys.readouterr().err == ""
    assert "--metrics-port" not in ap.format_help()


def test_exit_code_table_is_stable() -> None:
    assert [c for c, _ in exit_codes.TABLE] == [0, 1, 2, 3, 4, 130]
    assert (exit_codes.OK, exit_codes.FAILED, exit_codes.USAGE, exit_codes.NOT_DONE,
            exit_codes.UNAVAILABLE) == (0, 1, 2, 3, 4)
    assert "  4    backend unavailable" in exit_codes.epilog()
