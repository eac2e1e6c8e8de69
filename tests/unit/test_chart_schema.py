"""values.yaml and values.schema.json come from helm/values_model.py: they must be
current, every value documented, and every example values file valid."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, ValidationError

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "helm"))
import chart_tools as ct
import generate
import readme
from values_model import Values

EXAMPLES = sorted((ct.HELM_DIR / "examples").glob("*.yaml"))


def test_generated_files_are_current() -> None:
    stale = [str(p.relative_to(ct.ROOT)) for p, text in generate.outputs().items() if p.read_text() != text]
    assert not stale, f"run .venv/bin/python helm/generate.py: stale {stale}"


def _leaf_paths(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict) and node:
        return [p for k, v in node.items() for p in _leaf_paths(v, f"{prefix}{k}.")]
    return [prefix.rstrip(".")]


def test_the_chart_readme_lists_every_value_with_its_default() -> None:
    text = (ct.CHART / "README.md").read_text()
    assert text == readme.readme(Values()), "run .venv/bin/python helm/generate.py: README.md is stale"
    rows = {r[0].strip("`"): r for r in readme.rows(Values())}
    defaults = yaml.safe_load((ct.CHART / "values.yaml").read_text())
    for path in _leaf_paths(defaults):
        if path.count(".") and path.rsplit(".", 1)[0] in {r for r in rows if rows[r][1] in {"map", "list"}}:
            continue  # an entry inside a map or list value's default
        assert path in rows, f"{path} is missing from the chart README"
        assert f"| `{path}` |" in text
    assert rows["image.digest"][1:3] == ("string", '`""`')
    assert rows["ingest.keda.lagThreshold"][1:3] == ("integer", "`1000`")
    assert rows["logLevel"][1] == '"DEBUG" \\| "INFO" \\| "WARNING" \\| "ERROR"'
    assert "helm upgrade" in text and "helm install" in text


def _models(model: type[BaseModel]) -> list[type[BaseModel]]:
    found = [model]
    for info in model.model_fields.values():
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            found += _models(ann)
    return found


def test_every_value_is_documented() -> None:
    for model in _models(Values):
        for name, info in model.model_fields.items():
            where = f"{model.__name__}.{name}"
            assert info.description, f"{where} needs a docstring (it is the values.yaml comment)"


def test_values_yaml_is_the_models_defaults() -> None:
    shipped = yaml.safe_load((ct.CHART / "values.yaml").read_text())
    assert shipped == Values().model_dump(mode="json", by_alias=True)
    assert Values.model_validate(shipped) == Values()


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_values_are_valid(path: Path) -> None:
    Values.model_validate(yaml.safe_load(path.read_text()))


@pytest.mark.parametrize(
    "bad",
    [
        {"securityContext": {"runAsUser": 0}},
        {"kafka": {"bootstrapServers": "no-port"}},
        {"ingest": {"autoscaling": {"maxReplicas": 0}}},
        {"gateway": {"service": {"type": "Ingress"}}},
        {"typo": True},
    ],
)
def test_model_rejects_bad_values(bad: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        Values.model_validate(bad)


def test_a_missing_tool_fails_in_ci_and_skips_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="run scripts/tools"):
        ct.tool("rtrl-no-such-tool")
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="run scripts/tools"):
        ct.tool("rtrl-no-such-tool")
