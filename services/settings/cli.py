"""Settings of the ``rtrl`` operator commands (status, history, promote, rollback, pause,
resume, reconcile)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from services.settings.services import Section


class CliSettings(Section):
    """How long an operator command waits for a backend before it gives up (exit code 4)."""

    timeout_s: Annotated[int, Field(ge=1, le=60)] = 3
    """Longest wait, in whole seconds, for one call to MLflow, Redis or the Kafka broker: to
    connect, then for the answer. No call is retried, so a command whose backend is down ends
    within a few seconds. Whole seconds because MLflow's client reads its timeout as an integer
    (``MLFLOW_HTTP_REQUEST_TIMEOUT``, which wins when set in the environment)."""
