"""Reading the chart's rendered manifests, for the chart tests (test_chart_*.py): the types
of the ``render`` and ``refusal`` fixtures (tests/unit/conftest.py) and small lookups into
the parsed documents.

Imported by its basename, like kafka_fakes: pytest puts tests/unit on sys.path.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Protocol

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "helm"))
import chart_tools as ct

Docs = list[dict[str, Any]]
"""The documents of one ``helm template``, parsed."""


class Render(Protocol):
    def __call__(self, *args: str) -> Docs:
        """``helm template`` of the chart with these arguments (no --set is added); fails the
        test when helm refuses."""


class Refusal(Protocol):
    def __call__(self, *args: str) -> str:
        """helm's stderr for arguments the chart must refuse; fails the test when it renders."""


def render_with(helm: str, env: dict[str, str]) -> Render:
    def render(*args: str) -> Docs:
        proc = ct.helm_template(helm, env, list(args))
        assert proc.returncode == 0, proc.stderr
        return ct.documents(proc.stdout)
    return render


def refusal_with(helm: str, env: dict[str, str]) -> Refusal:
    def refusal(*args: str) -> str:
        proc = ct.helm_template(helm, env, list(args))
        assert proc.returncode != 0, f"rendered although it should not: {args}"
        return proc.stderr
    return refusal


def by_kind(docs: Docs, kind: str) -> Docs:
    return [d for d in docs if d["kind"] == kind]


def component_of(doc: dict[str, Any]) -> str:
    return str(doc["metadata"]["labels"]["app.kubernetes.io/component"])


def deployments(docs: Docs) -> dict[str, dict[str, Any]]:
    """The Deployments by component (gateway, ingest, reward, trainer, deployer, vllm)."""
    return {component_of(d): d for d in by_kind(docs, "Deployment")}


def deployment(docs: Docs, component: str) -> dict[str, Any]:
    return deployments(docs)[component]


def pod(dep: dict[str, Any]) -> dict[str, Any]:
    """The pod spec of a Deployment."""
    spec: dict[str, Any] = dep["spec"]["template"]["spec"]
    return spec


def container(dep: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [c for c in pod(dep)["containers"] if c["name"] == name]
    return found


def main_container(dep: dict[str, Any]) -> dict[str, Any]:
    """The component's own container (sidecars from <component>.sidecars sit beside it)."""
    return container(dep, component_of(dep))


def env_of(docs: Docs, component: str) -> dict[str, Any]:
    """The environment a component's container sees: the settings ConfigMap plus its env
    entries (a value, or the valueFrom of a Secret)."""
    (cm,) = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-settings")]
    env: dict[str, Any] = dict(cm["data"])
    container_env = main_container(deployment(docs, component))["env"]
    env.update({e["name"]: e.get("value", e.get("valueFrom")) for e in container_env})
    return env
