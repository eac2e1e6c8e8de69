"""The registry contract, run here against the in-memory fake and in
tests/integration/test_trainer_registry_mlflow.py against MLflow (sqlite and a server)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from deployer.adapters.memory import InMemoryRegistry
from deployer.registry import Registry, offer_candidate
from ingest.contracts.registry import CANDIDATE, CHAMPION, PREVIOUS, Tag


def make_policy_dir(root: Path, marker: str) -> Path:
    """A stand-in policy directory (manifest + a weights file) the registry must copy verbatim."""
    d = root / f"policy-{marker}"
    d.mkdir(parents=True)
    (d / "policy.json").write_text(json.dumps({"kind": "tiny-transformer", "config": {}}))
    (d / "model.pt").write_bytes(marker.encode() * 100)
    return d


class RegistryContract:
    """Subclasses provide a ``registry`` fixture returning a fresh, empty registry."""

    def test_register_returns_string_versions_in_order(self, registry: Registry, tmp_path: Path) -> None:
        assert isinstance(registry, Registry)
        v1 = registry.register(None, make_policy_dir(tmp_path, "a"), {Tag.KIND: "bootstrap"})
        v2 = registry.register(None, make_policy_dir(tmp_path, "b"), {Tag.PARENT_VERSION: v1})
        assert isinstance(v1, str) and isinstance(v2, str)
        assert int(v2) > int(v1)
        assert registry.versions() == [v1, v2]
        assert registry.get_tags(v1)[Tag.KIND] == "bootstrap"
        assert registry.get_tags(v2)[Tag.PARENT_VERSION] == v1

    def test_aliases_move_and_compare_as_strings(self, registry: Registry, tmp_path: Path) -> None:
        v1 = registry.register(None, make_policy_dir(tmp_path, "a"))
        v2 = registry.register(None, make_policy_dir(tmp_path, "b"))
        assert registry.alias_version(CHAMPION) is None
        registry.set_alias(CHAMPION, v1)
        registry.set_alias(CANDIDATE, v2)
        assert registry.alias_version(CHAMPION) == v1
        assert registry.alias_version(CANDIDATE) == v2
        # promotion: previous <- champion, champion <- candidate, candidate removed
        registry.set_alias(PREVIOUS, v1)
        registry.set_alias(CHAMPION, v2)
        registry.delete_alias(CANDIDATE)
        assert (registry.alias_version(PREVIOUS), registry.alias_version(CHAMPION)) == (v1, v2)
        assert registry.alias_version(CANDIDATE) is None
        registry.delete_alias(CANDIDATE)  # idempotent

    def test_tags_merge_and_overwrite(self, registry: Registry, tmp_path: Path) -> None:
        v = registry.register(None, make_policy_dir(tmp_path, "a"), {Tag.GATE_RESULT: "fail"})
        registry.set_tags(v, {Tag.GATE_RESULT: "pass", Tag.GATE_REASONS: json.dumps([])})
        tags = registry.get_tags(v)
        assert tags[Tag.GATE_RESULT] == "pass"
        assert json.loads(tags[Tag.GATE_REASONS]) == []
        with pytest.raises(KeyError):
            registry.get_tags("999")

    def test_download_returns_the_policy_directory(self, registry: Registry, tmp_path: Path) -> None:
        v1 = registry.register(None, make_policy_dir(tmp_path, "a"))
        v2 = registry.register(None, make_policy_dir(tmp_path, "b"))
        got = registry.download(v2, tmp_path / "dl")
        assert (got / "policy.json").exists()
        assert (got / "model.pt").read_bytes() == b"b" * 100
        got1 = registry.download(v1, tmp_path / "dl1")
        assert (got1 / "model.pt").read_bytes() == b"a" * 100

    def test_register_rejects_a_missing_directory(self, registry: Registry, tmp_path: Path) -> None:
        with pytest.raises(FileNotFoundError):
            registry.register(None, tmp_path / "nope")


class TestInMemoryRegistry(RegistryContract):
    @pytest.fixture
    def registry(self, tmp_path: Path) -> Registry:
        return InMemoryRegistry(tmp_path / "store")

    def test_fake_rejects_unknown_versions_for_aliases(self, registry: Registry) -> None:
        with pytest.raises(KeyError):
            registry.set_alias(CHAMPION, "7")


RegistryFactory = Callable[[Path], Registry]


class RecordingLock:
    """A lock that records when it is held (unit tests only)."""

    def __init__(self) -> None:
        self.held = False
        self.entered = 0

    def __enter__(self) -> RecordingLock:
        self.held, self.entered = True, self.entered + 1
        return self

    def __exit__(self, *exc: object) -> None:
        self.held = False


class CheckingRegistry(InMemoryRegistry):
    """Fails if the candidate alias is read or moved outside the lock."""

    def __init__(self, root: Path, lock: RecordingLock) -> None:
        super().__init__(root)
        self.lock = lock

    def set_alias(self, alias: str, version: str) -> None:
        assert alias != CANDIDATE or self.lock.held, "candidate moved outside the lock"
        super().set_alias(alias, version)


def test_offer_candidate_checks_and_sets_under_the_lock(tmp_path: Path) -> None:
    lock = RecordingLock()
    reg = CheckingRegistry(tmp_path, lock)
    v1, v2, v3 = (reg.register(None, make_policy_dir(tmp_path, f"p{i}"), {}) for i in range(3))
    assert offer_candidate(reg, v1, lock) is None and reg.alias_version(CANDIDATE) == v1
    assert offer_candidate(reg, v2, lock) == v1, "an undecided candidate keeps the alias"
    assert reg.alias_version(CANDIDATE) == v1
    assert offer_candidate(reg, v1, lock) is None, "offering the holder again is a no-op"
    reg.set_tags(v1, {Tag.CANARY_OUTCOME: "running"})  # what the deployer tags at canary start
    assert offer_candidate(reg, v2, lock) == v1, "a canary in progress keeps the alias"
    reg.set_tags(v1, {Tag.CANARY_OUTCOME: "promoted"})
    assert offer_candidate(reg, v3, lock) is None and reg.alias_version(CANDIDATE) == v3
    assert lock.entered == 5


def test_offer_candidate_without_a_lock(tmp_path: Path) -> None:
    reg = InMemoryRegistry(tmp_path)
    v1 = reg.register(None, make_policy_dir(tmp_path, "p"), {})
    assert offer_candidate(reg, v1) is None and reg.alias_version(CANDIDATE) == v1
