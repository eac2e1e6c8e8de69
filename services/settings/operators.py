"""Settings of operator decisions: the keys the deployer verifies manual commands with, the
identity the CLI signs them with (section ``operators``), and the approval gate of the
canary (``deployer.approval``). docs/operations.md shows how to create and rotate keys.

Composed into the settings tree by services/settings/model.py and service_settings.py;
nothing here reads the environment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, SecretStr


class _Section(BaseModel):
    # The same as service_settings.Section, which imports this module (no cycle).
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class ApprovalSettings(_Section):
    """``deployer.approval``: a canary that passes the judge waits for an operator."""

    required: bool = False
    """Wait in phase awaiting_approval after the judge's promote verdict at the last step,
    until ``rtrl approve VERSION`` promotes it or ``rtrl rollback`` rejects it. Off: the
    judge's verdict promotes by itself."""
    timeout_s: Annotated[float, Field(gt=0.0)] = 24 * 3600.0
    """Longest wait for the approval; then the canary is rolled back with the reason
    "approval timed out" (it never ships without a decision)."""


class OperatorSettings(_Section):
    """``operators``: who may promote, roll back, pause, resume and approve by hand."""

    keys_file: Path | None = None
    """The deployer's operator keys: one ``name:sha256-hex-of-token`` per line (or a JSON
    object name -> hex), read at every tick so a rotated Secret applies without a restart."""
    keys: SecretStr | None = None
    """The same content given inline (e.g. an env var from a Secret); added to keys_file's."""
    allow_unauthenticated: bool = False
    """Accept unsigned commands as operator ``unauthenticated`` (development only). Off:
    unsigned commands are refused, and with no keys at all every manual command is."""
    max_age_s: Annotated[float, Field(gt=0.0)] = 300.0
    """A signed command is executed only within this many seconds of its signing (either
    way, for clock skew); an older copy is refused as expired."""
    name: str | None = None
    """CLI: the operator name to sign as (default: ``$USER``); must be a name in the keys."""
    token: SecretStr | None = None
    """CLI: the operator's secret token (``RTRL_OPERATORS__TOKEN``; or ``--token-file``)."""
