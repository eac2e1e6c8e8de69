"""docs/configuration.md is generated from the settings models and stays current: every
setting has a row with its variable, type, default and the field's own docstring."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import pytest
from pydantic import BaseModel, Field, SecretStr

from services.settings import reference as ref
from services.settings.model import Settings

pytestmark = pytest.mark.unit


def test_the_committed_reference_is_current() -> None:
    assert ref.DOC.read_text() == ref.render(), \
        "docs/configuration.md is stale: run python -m services.settings.reference --write"
    assert ref.main(["--check"]) == 0


def _leaves(model: type[BaseModel], prefix: str) -> list[tuple[str, str]]:
    out = []
    for name, field in model.model_fields.items():
        nested = ref._section_model(field.annotation)
        if nested is not None:
            out += _leaves(nested, f"{prefix}{name.upper()}__")
        else:
            out.append((f"{prefix}{name.upper()}", field.description or ""))
    return out


def test_every_setting_has_a_documented_row() -> None:
    text = ref.render()
    leaves = _leaves(Settings, "RTRL_")
    assert len(leaves) > 150
    undocumented = [env for env, doc in leaves if not doc.strip()]
    assert undocumented == [], "settings without a docstring (add one under the field)"
    for env, _ in leaves:
        assert f"| `{env}` |" in text


def test_known_rows_read_as_a_user_sets_them() -> None:
    text = ref.render()
    row = "| `RTRL_KAFKA__BOOTSTRAP_SERVERS` | str | `127.0.0.1:9092` | Comma-separated host:port list. |"
    assert row in text
    assert "| `RTRL_REDIS__URL` | secret | (secret) |" in text  # a secret's default never prints
    assert "| `RTRL_TRAINER__GATE__" in text  # a nested section gets its own __ level


class _Probe(BaseModel):
    mode: Literal["a", "b"] = "a"
    limit: Annotated[int, Field(ge=1, le=9)] = 3
    maybe: float | None = None
    keys: dict[str, SecretStr] = Field(default_factory=dict)
    path: Path = Path("x")
    token: SecretStr = SecretStr("s3cret")
    needed: int


def test_types_defaults_and_limits_against_a_plain_reference() -> None:
    f = _Probe.model_fields
    assert ref.type_name(f["mode"].annotation) == "one of `a`, `b`"
    assert ref.type_name(f["maybe"].annotation) == "float (optional)"
    assert ref.type_name(f["keys"].annotation) == "JSON object"
    assert ref.type_name(f["path"].annotation) == "path"
    assert ref.limits_text(f["limit"]) == " (≥ 1, ≤ 9)"
    assert [ref.default_text(f[n]) for n in ("mode", "maybe", "keys", "path", "token", "needed")] == \
        ["`a`", "none", "empty", "`x`", "(secret)", "required"]
    assert "s3cret" not in ref.default_text(f["token"])
