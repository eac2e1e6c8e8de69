"""Bounds on the MLflow client's own HTTP behaviour for the processes that retry by themselves.

MLflow's client reads ``MLFLOW_HTTP_REQUEST_TIMEOUT`` (default 120 s) and
``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` (default 7, backoff factor 2: about 4 minutes) from the
environment at every request, and it retries every method, POST included. A deployer tick
stuck that long in one call outlives its Redis lease, and a replayed ``create_model_version``
can register a window twice. The trainer and the deployer therefore set both from
``settings.mlflow`` at start-up (see :func:`bound_mlflow_http`) and do their own retrying:
``trainer.registry_retry_s`` around the registry calls after training, the next tick for the
deployer. Variables an operator sets in the environment are left alone.
"""

from __future__ import annotations

import os

from redis import RedisError
from requests import RequestException

from services.runtime.settings import MlflowSettings

TIMEOUT_VAR = "MLFLOW_HTTP_REQUEST_TIMEOUT"
RETRIES_VAR = "MLFLOW_HTTP_REQUEST_MAX_RETRIES"


def bound_mlflow_http(m: MlflowSettings) -> dict[str, str]:
    """Set the MLflow client's request timeout and retries for this process unless they are
    set already; return the values in effect."""
    os.environ.setdefault(TIMEOUT_VAR, str(m.http_timeout_s))
    os.environ.setdefault(RETRIES_VAR, str(m.http_max_retries))
    return {TIMEOUT_VAR: os.environ[TIMEOUT_VAR], RETRIES_VAR: os.environ[RETRIES_VAR]}


def dependency_of(exc: BaseException) -> str | None:
    """Which dependency an exception from a deployer tick came from: mlflow, redis, kafka or None."""
    from mlflow.exceptions import MlflowException

    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, MlflowException | RequestException):
            return "mlflow"
        if isinstance(cur, RedisError):
            return "redis"
        if type(cur).__module__.startswith("kafka"):
            return "kafka"
        cur = cur.__cause__ or cur.__context__
    return None
