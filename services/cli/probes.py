"""Bounded reachability checks of Redis and the broker for commands that then run for
minutes with the services' own timeouts (``rtrl train --now``, ``rtrl bootstrap``,
``rtrl sample``, ``rtrl reconcile``). Each raises :class:`BackendUnavailableError` within
``RTRL_CLI__TIMEOUT_S``. Kept apart from services/cli/backends.py, which imports no client
library so that ``rtrl --help`` stays fast; MLflow's check is there (``probe_mlflow``).
"""

from __future__ import annotations

from services.cli.backends import (
    Backend,
    BackendUnavailableError,
    Failure,
    backend_failure,
    bounded_settings,
    probe_mlflow,
)
from services.runtime.kafka_io import wait_for_broker
from services.runtime.redis_io import make_redis
from services.settings.model import Settings


def probe_broker(settings: Settings) -> None:
    """A broker of ``settings.kafka`` answers within ``settings.cli.timeout_s``."""
    try:
        wait_for_broker(bounded_settings(settings).kafka, timeout_s=settings.cli.timeout_s)
    except TimeoutError as exc:  # no broker answered (refused or silent: kafka-python does not say)
        raise BackendUnavailableError(Failure("kafka", refused=False)) from exc


def probe_redis(settings: Settings) -> None:
    """Redis answers a PING within ``settings.cli.timeout_s``."""
    client = make_redis(settings.redis, settings.cli.timeout_s)
    try:
        client.ping()
    except Exception as exc:
        failure = backend_failure(exc)
        if failure is None:
            raise
        raise BackendUnavailableError(failure) from exc
    finally:
        client.close()


def preflight(settings: Settings, backends: tuple[Backend, ...]) -> None:
    """Check ``backends`` in order; raise for the first that does not answer. Call it before
    logging is set up, so the clients' connection warnings are not printed."""
    for backend in backends:
        if backend == "mlflow":
            probe_mlflow(settings.mlflow.tracking_uri, settings.cli.timeout_s)
        elif backend == "redis":
            probe_redis(settings)
        else:
            probe_broker(settings)
