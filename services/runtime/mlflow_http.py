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

import logging
import os
from collections.abc import MutableMapping

from ingest.contracts import prometheus as metrics
from services.settings.model import MlflowSettings

TIMEOUT_VAR = "MLFLOW_HTTP_REQUEST_TIMEOUT"
RETRIES_VAR = "MLFLOW_HTTP_REQUEST_MAX_RETRIES"


def bound_mlflow_client(timeout_s: float, max_retries: int,
                        environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set the MLflow client's request timeout and retries in ``environ`` (this process's
    environment by default) unless they are set already; return the values in effect."""
    env = os.environ if environ is None else environ
    env.setdefault(TIMEOUT_VAR, f"{timeout_s:g}")
    env.setdefault(RETRIES_VAR, str(max_retries))
    return {TIMEOUT_VAR: env[TIMEOUT_VAR], RETRIES_VAR: env[RETRIES_VAR]}


def bound_mlflow_http(m: MlflowSettings) -> dict[str, str]:
    """:func:`bound_mlflow_client` with the long-running processes' ``settings.mlflow``."""
    return bound_mlflow_client(m.http_timeout_s, m.http_max_retries)


# The package an exception class comes from → the dependency it stands for. Matched on the
# classes' modules, so that recognising an error imports none of the clients.
_DEPENDENCY_OF_PACKAGE = {"mlflow": "mlflow", "requests": "mlflow", "urllib3": "mlflow",
                          "redis": "redis", "kafka": "kafka"}


def dependency_of(exc: BaseException) -> str | None:
    """Which dependency an exception from a deployer tick or a trainer check came from: mlflow,
    redis, kafka or None. The exception, its causes and contexts, and their base classes are looked at."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        for cls in type(cur).__mro__:
            dep = _DEPENDENCY_OF_PACKAGE.get(cls.__module__.split(".")[0])
            if dep is not None:
                return dep
        cur = cur.__cause__ or cur.__context__
    return None


def retry_later(service: str, what: str, exc: BaseException, log: logging.Logger) -> None:
    """The rule for a periodic job (a deployer tick, a trainer check, a holdout measurement) that
    failed and will simply run again: a dependency's failure is one warning line and a count in
    ``rtrl_dependency_retries_total{service, dependency}``; anything else is logged with its
    traceback and not counted."""
    dep = dependency_of(exc)
    if dep is None:
        log.exception("%s failed; the next one retries", what)
        return
    metrics.DEPENDENCY_RETRIES.labels(service, dep).inc()
    log.warning("%s failed: %s unavailable (%s: %s); the next one retries", what, dep, type(exc).__name__,
                str(exc)[:300])
