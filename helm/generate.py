"""Writes the chart's generated files from helm/values_model.py (with the sections in
helm/values_components.py) and helm/dashboard.py:

    helm/rtrl/values.yaml               defaults, each value preceded by its docstring
    helm/rtrl/values.schema.json        what `helm lint/template/install` rejects
    helm/rtrl/files/dashboards/rtrl.json
    helm/rtrl/README.md                 install, upgrade and a table of every value (helm/readme.py)

Run `.venv/bin/python helm/generate.py` after editing either module; `--check` exits 1
when a file is stale (tests/unit/test_chart_schema.py runs it).
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

sys.path.insert(0, str(Path(__file__).resolve().parent))

import dashboard
import readme
from values_model import Values

CHART = Path(__file__).resolve().parent / "rtrl"
HEADER = """\
# Default values of the rtrl chart. GENERATED from helm/values_model.py by
# helm/generate.py: edit the model (each value's comment is its docstring), then
# regenerate. values.schema.json comes from the same model and rejects bad values.
"""


def _comment(text: str | None, indent: str) -> list[str]:
    if not text:
        raise ValueError("every value needs a docstring in helm/values_model.py or values_components.py")
    body = " ".join(text.split())
    lines = textwrap.wrap(body, width=94 - len(indent), break_on_hyphens=False)
    return [f"{indent}# {line}" for line in lines]


def _scalar_or_block(key: str, value: Any, indent: str) -> list[str]:
    dumped = yaml.safe_dump({key: value}, default_flow_style=False, sort_keys=False, width=200)
    return [indent + line for line in dumped.rstrip("\n").split("\n")]


def _emit(model: BaseModel, depth: int) -> list[str]:
    indent = "  " * depth
    lines: list[str] = []
    for name, info in type(model).model_fields.items():
        key = info.alias or name
        value = getattr(model, name)
        if depth == 0 and lines:
            lines.append("")
        lines += _comment(info.description, indent)
        if isinstance(value, BaseModel):
            lines.append(f"{indent}{key}:")
            lines += _emit(value, depth + 1)
        else:
            plain = json.loads(json.dumps(value, default=str))
            lines += _scalar_or_block(key, plain, indent)
    return lines


def values_yaml() -> str:
    return HEADER + "\n" + "\n".join(_emit(Values(), 0)) + "\n"


def _close_pattern_maps(node: Any) -> None:
    """pydantic writes dict[Annotated[str, pattern], ...] as patternProperties alone, which
    lets any other key through; close those maps so a badly named key is rejected."""
    if isinstance(node, dict):
        if "patternProperties" in node:
            node.setdefault("additionalProperties", False)
        for child in node.values():
            _close_pattern_maps(child)
    elif isinstance(node, list):
        for child in node:
            _close_pattern_maps(child)


def values_schema() -> str:
    schema = Values.model_json_schema(by_alias=True, mode="validation")
    _close_pattern_maps(schema)
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}
    return json.dumps(schema, indent=2, sort_keys=False) + "\n"


def dashboard_json() -> str:
    return json.dumps(dashboard.build(), indent=2) + "\n"


def outputs() -> dict[Path, str]:
    return {
        CHART / "values.yaml": values_yaml(),
        CHART / "values.schema.json": values_schema(),
        CHART / "files" / "dashboards" / "rtrl.json": dashboard_json(),
        CHART / "README.md": readme.readme(Values()),
    }


def main(argv: list[str]) -> int:
    stale = [path for path, text in outputs().items() if not path.exists() or path.read_text() != text]
    if "--check" in argv:
        for path in stale:
            print(f"stale: {path} (run python helm/generate.py)", file=sys.stderr)
        return 1 if stale else 0
    for path, text in outputs().items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
