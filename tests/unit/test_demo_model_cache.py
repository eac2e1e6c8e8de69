"""The vLLM demo's base model cache: a second run with the same key copies, anything that
shapes the model makes a new key, an interrupted or unwritable cache never breaks a run."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from services.demo import chat_model
from services.demo.chat_model import BUILDER_SOURCES, CACHE_DONE, cached_demo_model, model_key
from services.settings.demo import DemoSettings
from services.settings.model import settings_from_env

REPO = Path(__file__).resolve().parents[2]


class Builder:
    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, dst: Path, seed: int, **_: Any) -> Path:
        self.calls.append(seed)
        dst.mkdir(parents=True, exist_ok=True)
        (dst / "model.safetensors").write_text(f"weights of seed {seed}")
        (dst / "tokenizer.json").write_text("{}")
        return dst


def quiet(_line: str) -> None:
    return None


def test_a_second_run_copies_the_model_instead_of_building_it(tmp_path: Path) -> None:
    build, cache = Builder(), tmp_path / "cache"
    first = cached_demo_model(tmp_path / "a" / "model", 3, cache, say=quiet, build=build)
    second = cached_demo_model(tmp_path / "b" / "model", 3, cache, say=quiet, build=build)
    assert build.calls == [3]
    assert (second / "model.safetensors").read_text() == "weights of seed 3"
    assert sorted(p.name for p in second.iterdir()) == sorted(p.name for p in first.iterdir())
    assert not (second / CACHE_DONE).exists()
    cached_demo_model(tmp_path / "c" / "model", 4, cache, say=quiet, build=build)
    assert build.calls == [3, 4]  # another seed is another model


def test_an_interrupted_build_in_the_cache_is_built_again(tmp_path: Path) -> None:
    build, cache = Builder(), tmp_path / "cache"
    key = model_key(5)
    (cache / key).mkdir(parents=True)
    (cache / key / "model.safetensors").write_text("half")  # no done marker
    out = cached_demo_model(tmp_path / "m", 5, cache, say=quiet, build=build)
    assert build.calls == [5]
    assert (out / "model.safetensors").read_text() == "weights of seed 5"


def test_no_cache_or_an_unwritable_one_still_builds(tmp_path: Path) -> None:
    build = Builder()
    cached_demo_model(tmp_path / "m1", 1, None, say=quiet, build=build)
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    lines: list[str] = []
    out = cached_demo_model(tmp_path / "m2", 1, blocker / "cache", say=lines.append, build=build)
    assert build.calls == [1, 1]
    assert (out / "model.safetensors").exists()
    assert any("not cached" in line for line in lines)


def test_the_key_follows_the_seed_the_sizes_and_the_builders_source(tmp_path: Path) -> None:
    base = model_key(0)
    assert model_key(0) == base
    assert len({base, model_key(1), model_key(0, epochs=chat_model.PRETRAIN_EPOCHS + 1),
                model_key(0, n_pairs=chat_model.PRETRAIN_PAIRS + 1), model_key(0, agent=True)}) == 5
    for rel in BUILDER_SOURCES:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / rel, tmp_path / rel)
    assert model_key(0, root=tmp_path) == base
    (tmp_path / BUILDER_SOURCES[1]).write_text((REPO / BUILDER_SOURCES[1]).read_text() + "\n# changed\n")
    assert model_key(0, root=tmp_path) != base


def test_the_cache_defaults_under_the_home_and_can_be_turned_off(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    default = DemoSettings().model_cache_dir
    assert default is not None
    build = Builder()
    cached_demo_model(tmp_path / "m", 2, default, say=quiet, build=build)
    assert (tmp_path / ".cache" / "rtrl" / "demo-models" / model_key(2) / CACHE_DONE).exists()
    assert DemoSettings(model_cache_dir=None).model_cache_dir is None
    assert settings_from_env({"RTRL_DEMO__MODEL_CACHE_DIR": "null"}).demo.model_cache_dir is None
