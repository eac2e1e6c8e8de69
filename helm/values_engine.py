"""The chart's engine section: where the gateway serves from and where the deployer loads
candidates (an external OpenAI-compatible engine, or a vLLM server the chart runs), used by
helm/values_model.py. As there, each field's docstring is its comment in values.yaml and its
description in values.schema.json; run ``python helm/generate.py`` after editing.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field
from values_components import (
    VALUES_CONFIG,
    PodExtras,
    Quantity,
    ResourceList,
    Resources,
    SecretKeyRef,
    UnprivilegedPort,
)


class _Values(BaseModel):
    model_config = VALUES_CONFIG


class EngineAdapters(_Values):
    claim_name: str = ""
    """An existing PersistentVolumeClaim (ReadWriteMany when the engine runs on other nodes)
    that the deployer writes candidates' adapters to and the engine loads them from. Empty
    with create true makes one."""
    create: bool = False
    """Create the claim (size, storageClassName, accessMode below)."""
    size: Quantity = "10Gi"
    """Size of the created claim (a LoRA adapter is a few MB to a few hundred MB)."""
    storage_class_name: str = ""
    """StorageClass of the created claim; empty uses the cluster default."""
    access_mode: Literal["ReadWriteMany", "ReadWriteOnce"] = "ReadWriteMany"
    """ReadWriteOnce only when the deployer and the engine share a node."""
    deployer_path: str = "/var/lib/rtrl/adapters"
    """Where the deployer mounts it (RTRL_ENGINE__ADAPTER_DIR)."""
    engine_path: str = "/adapters"
    """Where the engine sees it (RTRL_ENGINE__ENGINE_ADAPTER_DIR): the chart's vLLM mounts it
    there; an external engine must mount the same volume at this path."""


class EngineVllm(PodExtras, _Values):
    enabled: bool = False
    """Run a vLLM server with the chart (a Deployment and a Service) with runtime LoRA
    updating on; engine.baseUrl then defaults to it."""
    image: str = "vllm/vllm-openai:v0.32.0"
    """vLLM image (the CUDA build; use a CPU or ROCm build to match the nodes)."""
    model: str = ""
    """The base model: a path inside modelClaim (e.g. /models/my-model) or a hub name the
    pod can download. Required when enabled."""
    model_claim: str = ""
    """An existing PersistentVolumeClaim with the model weights, mounted read-only at /models."""
    max_loras: Annotated[int, Field(ge=1)] = 4
    """Adapters the engine holds at once (--max-loras): stable, canary and a spare."""
    max_lora_rank: Annotated[int, Field(ge=1)] = 64
    """Largest adapter rank it accepts (--max-lora-rank); at least the trainer's rank."""
    extra_args: list[str] = []
    """More vllm serve arguments, e.g. [--dtype, bfloat16, --max-model-len, "8192"]."""
    port: UnprivilegedPort = 8000
    """Container and Service port of its OpenAI-compatible API."""
    replicas: Annotated[int, Field(ge=1)] = 1
    """Engine pods. The deployer loads each adapter into every pod behind the Service only
    if each is addressed; keep 1 unless a load balancer fans adapter loads out."""
    resources: Resources = Resources(
        requests=ResourceList(cpu="4", memory="16Gi"), limits=ResourceList(memory="32Gi")
    )
    """Container resources; add the GPU under limits, e.g. nvidia.com/gpu: 1."""
    node_selector: dict[str, str] = {}
    """Node labels the pods must match (e.g. a GPU node pool)."""
    tolerations: list[dict[str, Any]] = []
    """Tolerations, as in a PodSpec (e.g. for nvidia.com/gpu taints)."""
    affinity: dict[str, Any] = {}
    """Affinity, as in a PodSpec."""
    runtime_class_name: str = ""
    """RuntimeClass (e.g. nvidia)."""
    shm_size_limit: Quantity = "8Gi"
    """Size of /dev/shm (tensor-parallel workers share memory through it)."""


class Engine(_Values):
    kind: Literal["local", "vllm"] = "local"
    """local: rtrl's own policies, in the gateway; vllm: an OpenAI-compatible engine with
    vLLM's runtime LoRA API that the deployer loads each candidate's adapter into before it
    serves (RTRL_ENGINE__KIND, docs/serving.md)."""
    base_url: str = ""
    """The engine's URL without /v1, e.g. http://vllm.serving:8000; empty with
    vllm.enabled uses the chart's vLLM Service."""
    base_model: str = "base"
    """The name the engine serves the base weights under (vLLM --served-model-name); it
    serves the stable arm while no champion exists."""
    api_key: str = ""
    """Bearer key of the engine (vLLM --api-key), stored in the chart's Secret."""
    existing_secret: SecretKeyRef = SecretKeyRef(key="engine-api-key")
    """Read the engine's key from an existing Secret."""
    adapters: EngineAdapters = EngineAdapters()
    """The volume that carries adapters from the deployer to the engine."""
    vllm: EngineVllm = EngineVllm()
    """An optional vLLM server run by the chart."""
