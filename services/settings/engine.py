"""Where the gateway and the deployer find the inference engine (docs/serving.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr

from services.settings.services import Section


class EngineSettings(Section):
    """The inference engine the gateway serves from (docs/serving.md). ``local``: rtrl's own
    policies, loaded in-process from the MLflow registry. ``vllm``: an OpenAI-compatible
    engine (vLLM, or any server with vLLM's runtime LoRA API) that the deployer loads each
    candidate's adapter into before it gets traffic."""

    kind: Literal["local", "vllm"] = "local"
    """``local``: rtrl's own policies in the gateway process; ``vllm``: an engine at ``base_url``."""
    base_url: str | None = None
    """The engine's base URL without ``/v1``, e.g. ``http://rtrl-vllm:8000`` (kind vllm)."""
    api_key: SecretStr | None = None
    """Sent to the engine as ``Authorization: Bearer ...`` when set (vLLM ``--api-key``)."""
    base_model: str | None = None
    """The model name the engine serves its base weights as (vLLM ``--served-model-name``);
    it serves the stable arm while the registry has no champion."""
    base_version: str = "base"
    """Version label of the base model in served events while no champion exists."""
    adapter_dir: Path | None = None
    """Where the deployer writes candidates' adapters for the engine to load (a volume shared
    with the engine)."""
    engine_adapter_dir: Path | None = None
    """The same directory as the engine sees it (None: ``adapter_dir``)."""
    timeout_s: Annotated[float, Field(gt=0.0)] = 60.0
    """Longest wait for one engine response (a whole non-streamed completion)."""
