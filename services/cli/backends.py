"""Bounds on every call an ``rtrl`` command makes to MLflow, Redis and Kafka, and the one line
an operator reads when one of them does not answer.

Left alone, the clients wait for minutes on a backend that is down: MLflow's client retries
each request 7 times with a backoff factor of 2 and waits up to 120 s per attempt (about 4 min
against a closed port), redis-py retries a command 10 times, and kafka-python waits 30 s to
bootstrap. An operator in an incident needs an answer in seconds, so the operator commands
bound each call to ``settings.cli.timeout_s`` (``RTRL_CLI__TIMEOUT_S``, default 3 s) with no
client-side retries
(:func:`bound_mlflow_env`, :func:`bounded_settings`, ``make_redis(..., timeout_s=)``), and
:func:`backend_failure` recognises the clients' connection errors so the command can exit with
:data:`~services.cli.exit_codes.UNAVAILABLE` instead of printing a traceback.

Exceptions are recognised by their class names and modules, so this module imports none of
the clients (``rtrl --help`` stays fast).
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Literal

from services.runtime.mlflow_http import TIMEOUT_VAR, bound_mlflow_client
from services.settings.model import Settings

Backend = Literal["mlflow", "redis", "kafka"]
NAMES: dict[Backend, str] = {"mlflow": "MLflow", "redis": "Redis", "kafka": "Kafka"}
SETTING: dict[Backend, str] = {"mlflow": "RTRL_MLFLOW__TRACKING_URI", "redis": "RTRL_REDIS__URL",
                               "kafka": "RTRL_KAFKA__BOOTSTRAP_SERVERS"}

# Class names (anywhere in an exception's MRO) that mean "could not talk to the backend".
_CONNECTION = {
    "mlflow": ("ConnectionError", "Timeout", "MaxRetryError", "NewConnectionError", "ProtocolError"),
    "redis": ("ConnectionError", "TimeoutError", "BusyLoadingError"),
    "kafka": ("KafkaTimeoutError", "KafkaConnectionError", "NodeNotReadyError",
              "RequestTimedOutError"),
}
_MODULES: dict[str, Backend] = {"requests": "mlflow", "urllib3": "mlflow", "redis": "redis", "kafka": "kafka"}


@dataclass(frozen=True)
class Failure:
    """A backend that could not be reached: which one, and whether it refused the connection
    (nothing listens) or did not answer in time."""

    backend: Backend
    refused: bool


class BackendUnavailableError(Exception):
    """Raised by :func:`probe_mlflow`: the backend of ``failure`` could not be reached."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(f"{NAMES[failure.backend]} {'refused' if failure.refused else 'did not answer'}")
        self.failure = failure


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and all(cur is not e for e in out):
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def _backend(exc: BaseException) -> Backend | None:
    backend = _MODULES.get(type(exc).__module__.split(".")[0])
    if backend is None:
        return None
    names = {k.__name__ for k in type(exc).__mro__}
    return backend if names & set(_CONNECTION[backend]) else None


def backend_failure(exc: BaseException) -> Failure | None:
    """The backend an exception says could not be reached, or None for any other error
    (a bug, a rejected request, a missing model), which must not be hidden."""
    if isinstance(exc, BackendUnavailableError):
        return exc.failure
    chain = _chain(exc)
    backend = next((b for b in map(_backend, chain) if b is not None), None)
    if backend is None:
        return None
    refused = any(isinstance(e, ConnectionRefusedError) or "Connection refused" in str(e) for e in chain)
    return Failure(backend, refused)


def _without_credentials(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}{rest.rsplit('@', 1)[-1]}" if sep else url.rsplit("@", 1)[-1]


def address(settings: Settings, backend: Backend) -> str:
    """Where the backend is expected, without credentials."""
    if backend == "mlflow":
        return _without_credentials(settings.mlflow.tracking_uri)
    if backend == "redis":
        return _without_credentials(settings.redis.url.get_secret_value())
    return settings.kafka.bootstrap_servers


def message(command: str, failure: Failure, settings: Settings, timeout_s: float | None) -> str:
    """The one line printed to stderr, e.g. ``rtrl history: MLflow at http://127.0.0.1:5999 did
    not answer within 3s (set RTRL_MLFLOW__TRACKING_URI)``."""
    within = "" if timeout_s is None else f" within {timeout_s:g}s"
    what = "refused the connection" if failure.refused else f"did not answer{within}"
    return (f"rtrl {command}: {NAMES[failure.backend]} at {address(settings, failure.backend)} {what} "
            f"(set {SETTING[failure.backend]})")


def bound_mlflow_env(timeout_s: int, environ: MutableMapping[str, str] | None = None) -> float:
    """Make MLflow's client wait at most ``timeout_s`` per request and not retry, unless the
    environment sets either already; return the request timeout in effect. MLflow reads both
    variables at every request."""
    in_effect = bound_mlflow_client(timeout_s, 0, environ)
    try:
        return float(in_effect[TIMEOUT_VAR])
    except ValueError:
        return float(timeout_s)


def bounded_settings(settings: Settings) -> Settings:
    """``settings`` with the Kafka clients' bootstrap and request timeouts at most
    ``settings.cli.timeout_s``."""
    ms = settings.cli.timeout_s * 1000
    k = settings.kafka
    kafka = k.model_copy(update={"request_timeout_ms": min(k.request_timeout_ms, ms),
                                 "bootstrap_timeout_ms": min(k.bootstrap_timeout_ms, ms)})
    return settings.model_copy(update={"kafka": kafka})


def probe_mlflow(tracking_uri: str, timeout_s: float) -> None:
    """Raise :class:`BackendUnavailableError` unless an HTTP tracking server at ``tracking_uri``
    answers (any HTTP status will do) within ``timeout_s``. Done before MLflow is imported, which
    takes seconds on a busy machine; other URIs (``sqlite:``, ``databricks``) are left to MLflow."""
    if not tracking_uri.startswith(("http://", "https://")):
        return
    url = f"{tracking_uri.rstrip('/')}/health"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s):  # noqa: S310 -- http(s) only, checked above
            return
    except urllib.error.HTTPError:
        return  # it answered
    except (urllib.error.URLError, OSError) as exc:
        refused = isinstance(getattr(exc, "reason", exc), ConnectionRefusedError)
        raise BackendUnavailableError(Failure("mlflow", refused)) from exc
