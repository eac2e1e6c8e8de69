"""The model registry port: versions of one registered policy, their tags and three aliases.

Conventions (shared by trainer, deployer, gateway and the operator CLI):

- one registered model (``settings.mlflow.registered_model``, default ``rtrl-policy``);
- aliases ``champion`` (serves the stable arm), ``candidate`` (under canary) and
  ``previous`` (the last champion, for rollback); stages are not used;
- versions are strings everywhere (MLflow's sqlite store answers ints, REST answers strings);
- every version carries lineage and decision tags whose keys start with ``rtrl.`` (:class:`Tag`).

The real adapter is ``deployer/adapters/mlflow_registry.py``; ``InMemoryRegistry`` beside it
(``deployer/adapters/memory.py``) is the fake for unit tests. One contract test suite runs
against both.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Protocol, runtime_checkable

from ingest.contracts.registry import CANDIDATE, OUTCOME_RUNNING, POLICY_MANIFEST, Tag


def manifest_tags(directory: Path) -> dict[str, str]:
    """Registry tags that say what a saved policy is: its kind and, for an adapter, its base
    model (where it was trained, and by content hash)."""
    manifest = json.loads((directory / POLICY_MANIFEST).read_text())
    config = manifest.get("config", {})
    tags = {Tag.POLICY_KIND: str(manifest.get("kind", ""))}
    if "base_sha256" in config:
        tags[Tag.BASE_MODEL] = str(config.get("base", ""))
        tags[Tag.BASE_SHA256] = str(config["base_sha256"])
    return tags


def candidate_in_flight(registry: Registry) -> str | None:
    """The candidate version whose canary is not decided yet, or None.

    The deployer tags a version ``rtrl.canary.outcome=running`` when its canary starts and
    with the outcome when it decides it, so an alias on a version without an outcome (pending)
    or with ``running`` (under canary) is in flight. Moving the alias then would abort that
    canary; with a cadence shorter than a canary nothing could ever be promoted.
    """
    held = registry.alias_version(CANDIDATE)
    if held is None or registry.get_tags(held).get(Tag.CANARY_OUTCOME, OUTCOME_RUNNING) != OUTCOME_RUNNING:
        return None
    return held


class LockUnavailableError(RuntimeError):
    """The lock that serialises alias writers could not be taken (held too long, or its
    store is unreachable)."""


def offer_candidate(
    registry: Registry, version: str, lock: AbstractContextManager[object] | None = None
) -> str | None:
    """Point ``candidate`` at ``version`` unless another undecided candidate holds it.

    Returns None when offered, else the version that holds the alias. Every writer of the
    alias (the trainer, ``rtrl demo``'s injected candidate) goes through this under the same
    ``lock`` (the Redis one in production: :class:`deployer.adapters.redis_state.RedisLock`),
    so two writers can never both see a free alias and overwrite each other's candidate.
    Raises :class:`LockUnavailableError` when the lock cannot be taken (nothing is moved).
    """
    with lock if lock is not None else nullcontext():
        held = candidate_in_flight(registry)
        if held is not None and held != version:
            return held
        registry.set_alias(CANDIDATE, version)
        return None


@runtime_checkable
class Registry(Protocol):
    """Where policies are versioned. Every method raises on a registry error; none retries."""

    def register(
        self, run_id: str | None, policy_dir: str | Path, tags: Mapping[str, str] | None = None
    ) -> str:
        """Store the saved policy directory as a new version of the registered model and
        return its version. ``run_id`` names the run that produced it (None: a run is made)."""
        ...

    def set_alias(self, alias: str, version: str) -> None:
        """Point ``alias`` at ``version`` (moving it if it pointed elsewhere)."""
        ...

    def delete_alias(self, alias: str) -> None:
        """Remove ``alias``; no error when it does not exist."""
        ...

    def alias_version(self, alias: str) -> str | None:
        """The version ``alias`` points at, as a string, or None."""
        ...

    def set_tags(self, version: str, tags: Mapping[str, str]) -> None:
        """Set (overwrite) tags on a version; other tags are kept."""
        ...

    def get_tags(self, version: str) -> dict[str, str]:
        """All tags of a version; KeyError when the version does not exist."""
        ...

    def download(self, version: str, dst_dir: str | Path) -> Path:
        """Copy the version's policy directory under ``dst_dir``; return the directory that
        holds its ``policy.json`` (pass it to ``trainer.policy.load_policy``)."""
        ...

    def versions(self) -> list[str]:
        """All versions, oldest first."""
        ...
