"""Integration fixtures shared by several files: a sqlite MLflow store per module, and one
real vLLM engine per test session.

``vllm_engine`` builds a tiny Llama model with its own tokenizer (services/stack/tiny_llm.py),
starts vLLM's CPU build on it once (services/stack/engine.py; 35-200 s on 2 cores) and stops
it at the end of the session. Tests that load adapters give them names of their own.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from services.stack.engine import LocalVllm
from services.stack.tiny_llm import build_lora_adapter, build_tiny_llm, corrupt_adapter


@dataclass
class Engine:
    base_url: str
    model: str
    """The engine's served name of the base model."""
    model_dir: Path
    root: Path
    _adapters: dict[int, Path] = field(default_factory=dict)

    def adapter(self, seed: int) -> Path:
        """A LoRA adapter for the base model (built once per seed)."""
        if seed not in self._adapters:
            dst = self.root / f"adapter-{seed}"
            self._adapters[seed] = build_lora_adapter(self.model_dir, dst, seed=seed)
        return self._adapters[seed]

    def corrupt(self, seed: int) -> Path:
        return corrupt_adapter(self.adapter(seed), self.root / f"corrupt-{seed}")


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    """One local Ray (2 CPUs, loopback) per test module, shut down at its end."""
    from trainer.adapters.ray_train import ensure_ray

    ensure_ray(None, num_cpus=2, object_store_mb=200)
    yield
    import ray

    ray.shutdown()


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One sqlite MLflow store per test module (creating its tables takes seconds); tests give
    themselves their own registered model and deployments experiment (deployer_settings)."""
    root = tmp_path_factory.mktemp("mlflow")
    cwd = os.getcwd()
    os.chdir(root)  # the sqlite store puts artifacts under ./mlruns
    try:
        yield f"sqlite:///{root / 'mlflow.db'}"
    finally:
        os.chdir(cwd)


@pytest.fixture(scope="session")
def vllm_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    root = tmp_path_factory.mktemp("vllm")
    model_dir = build_tiny_llm(root / "base")
    with LocalVllm(model_dir, "tiny-base", root / "vllm.log") as engine:
        yield Engine(engine.base_url, "tiny-base", model_dir, root)
