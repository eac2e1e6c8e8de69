"""The chart's README (helm/rtrl/README.md, what `helm show readme` prints), written from
helm/values_model.py by helm/generate.py: an install and upgrade section, then one table
row per value (its path, type, default and docstring), so the reference never drifts from
values.yaml and values.schema.json.
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

INTRO = """\
# rtrl

Real-time RL for LLM and agent products: a gateway that serves completions and splits
users between a stable and a canary model, ingest and reward workers on Kafka, a trainer
that runs an RL increment every few hours, and a canary deployer that promotes or rolls
back by itself. Alerts (PrometheusRule) and a Grafana dashboard ship with the chart.

GENERATED from helm/values_model.py by helm/generate.py: edit the model, then regenerate.

## Install

The chart needs a Kafka, a Redis and an MLflow server it can reach, client API keys for the
gateway and the producer key it signs served events with; an install without them fails
saying what to set.

```bash
helm install rtrl helm/rtrl -n rtrl --create-namespace -f my-values.yaml \\
  --set auth.keys.gateway=$(openssl rand -hex 32) \\
  --set gateway.apiKeys.app=$(openssl rand -hex 32)
helm test rtrl -n rtrl      # the gateway's /readyz and /v1/models, each worker's /readyz
```

`helm/examples/` has values files for a small install, a Strimzi Kafka, a vLLM server on a
GPU and every extension point (sidecars, init containers, extra volumes, an Ingress, KEDA).

## Upgrade

```bash
helm upgrade rtrl helm/rtrl -n rtrl -f my-values.yaml
```

A change to the settings or to the chart's own Secret rolls the pods (checksum
annotations); after changing a Secret you manage, run `kubectl rollout restart deploy -l
app.kubernetes.io/instance=rtrl`. The trainer and the deployer run one pod each with the
Recreate strategy: an upgrade stops the old pod (which hands its work back) before the new
one starts. values.schema.json rejects unknown keys, so a value renamed between versions
fails the upgrade instead of being ignored.

Operations (alerts, runbooks, scaling): docs/operations.md in the repository.

## Values

| path | type | default | description |
|---|---|---|---|
"""


def _type_name(annotation: Any) -> str:
    """A short name of a value's type: string, integer, number, boolean, list, map, one of
    a literal's values, or a section's object."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin is typing.Literal:
        return " \\| ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        names = [_type_name(a) for a in args if a is not type(None)]
        return " or ".join(names) + (" or null" if type(None) in args else "")
    if origin is list:
        return "list"
    if origin is dict:
        return "map"
    simple = {str: "string", int: "integer", float: "number", bool: "boolean"}
    if annotation in simple:
        return simple[annotation]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "object"
    return str(annotation)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _default(value: Any) -> str:
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json", by_alias=True)
    return "`" + json.dumps(value, default=str).replace("|", "\\|") + "`"


def rows(model: BaseModel, prefix: str = "") -> Iterator[tuple[str, str, str, str]]:
    """(path, type, default, description) of every value, depth first; a section's own row
    comes before its values, and a list of sections (e.g. an Ingress's hosts) is one row."""
    for name, info in type(model).model_fields.items():
        path = f"{prefix}{info.alias or name}"
        value = getattr(model, name)
        yield from _rows_of(path, info, value)


def _rows_of(path: str, info: FieldInfo, value: Any) -> Iterator[tuple[str, str, str, str]]:
    description = _cell(info.description or "")
    if isinstance(value, BaseModel):
        yield f"`{path}`", "object", "", description
        yield from rows(value, f"{path}.")
    else:
        yield f"`{path}`", _type_name(info.annotation), _default(value), description


def readme(values: BaseModel) -> str:
    table = "\n".join(f"| {p} | {t} | {d} | {x} |" for p, t, d, x in rows(values))
    return INTRO + table + "\n"
