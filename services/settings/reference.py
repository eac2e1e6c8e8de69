"""The configuration reference (docs/configuration.md), generated from the settings models.

Every setting is an environment variable: ``RTRL_`` + section + ``__`` + field, upper case
(``RTRL_KAFKA__BOOTSTRAP_SERVERS``); a nested section adds another ``__``. The text of each
row is the field's docstring in services/runtime/*settings.py, so the reference cannot drift
from the code: ``python -m services.settings.reference --write`` regenerates it and
tests/unit/test_config_reference.py fails when the committed file is stale.
"""

from __future__ import annotations

import sys
import types
import typing
from enum import Enum
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from services.settings.model import Settings

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
HEADER = """# Configuration reference

Generated from the settings models by `python -m services.settings.reference --write`;
do not edit by hand (a unit test fails when this file is stale).

Every rtrl process reads its settings from `RTRL_*` environment variables once, at start-up.
Nested fields use `__`: `RTRL_KAFKA__BOOTSTRAP_SERVERS`. Lists and maps are JSON
(`RTRL_AUTH__KEYS='{"gateway":"..."}'`); `null` sets an optional value to none. After
`rtrl up`, the embedded stack's connection settings are read from `.rtrl/stack.env` when a
variable is not set. Unknown fields inside a section are refused at start-up, so a typo fails
loudly instead of being ignored. In the Helm chart the same variables are set by the values
(see `helm show readme`) or added with each component's `env`.
"""


def type_name(annotation: Any) -> str:
    """A reader's name for a field's type: ``int``, ``one of a, b``, ``JSON object``."""
    origin = typing.get_origin(annotation)
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if origin in (typing.Union, types.UnionType):
        inner = " or ".join(type_name(a) for a in args)
        return f"{inner} (optional)" if len(args) < len(typing.get_args(annotation)) else inner
    if origin is Literal:
        return "one of " + ", ".join(f"`{a}`" for a in typing.get_args(annotation))
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin in (dict, typing.Mapping) or annotation is dict:
        return "JSON object"
    if origin in (list, tuple, set, frozenset) or annotation in (list, tuple):
        return "JSON list"
    if isinstance(annotation, type):
        return _class_name(annotation)
    return str(annotation).replace("typing.", "")


def _class_name(cls: type) -> str:
    if issubclass(cls, SecretStr):
        return "secret"
    if issubclass(cls, Path):
        return "path"
    if issubclass(cls, Enum):
        return "one of " + ", ".join(f"`{m.value}`" for m in cls)
    if issubclass(cls, BaseModel):
        return "JSON object"
    return cls.__name__


def default_text(field: FieldInfo) -> str:
    """The default as a reader would set it; secrets never print."""
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, SecretStr):
        return "(secret)"
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, Enum):
        value = value.value
    if isinstance(value, dict | list | tuple) and not value:
        return "empty"
    return f"`{value}`"


def limits_text(field: FieldInfo) -> str:
    bounds = []
    for meta in field.metadata:
        for attr, sign in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
            if getattr(meta, attr, None) is not None:
                bounds.append(f"{sign} {getattr(meta, attr)}")
    return f" ({', '.join(bounds)})" if bounds else ""


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The settings section a field holds, when it is one (optional sections included)."""
    candidates = [annotation, *typing.get_args(annotation)]
    for c in candidates:
        if isinstance(c, type) and issubclass(c, BaseModel):
            return c
    return None


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def rows(model: type[BaseModel], prefix: str) -> list[tuple[str, str, str, str]]:
    """(variable, type, default, description) for every leaf field under ``model``."""
    out: list[tuple[str, str, str, str]] = []
    for name, field in model.model_fields.items():
        env = f"{prefix}{name.upper()}"
        nested = _section_model(field.annotation)
        if nested is not None:
            out.extend(rows(nested, env + "__"))
            continue
        out.append((env, type_name(field.annotation) + limits_text(field), default_text(field),
                    _cell(field.description or "")))
    return out


def render() -> str:
    """docs/configuration.md: one table per section, in the order Settings declares them."""
    parts = [HEADER]
    top: list[tuple[str, str, str, str]] = []
    for name, field in Settings.model_fields.items():
        section = _section_model(field.annotation)
        if section is None:
            top.append((f"RTRL_{name.upper()}", type_name(field.annotation), default_text(field),
                        _cell(field.description or "")))
            continue
        parts.append(f"\n## `{name}`\n\n{_cell(section.__doc__ or '')}\n")
        parts.append(_table(rows(section, f"RTRL_{name.upper()}__")))
    parts.append("\n## Process\n")
    parts.append(_table(top))
    return "".join(parts)


def _table(items: list[tuple[str, str, str, str]]) -> str:
    lines = ["\n| Variable | Type | Default | Description |", "|---|---|---|---|"]
    lines += [f"| `{env}` | {kind} | {default} | {text} |" for env, kind, default, text in items]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    text = render()
    if args == ["--write"]:
        DOC.write_text(text)
        print(f"wrote {DOC}")
        return 0
    if args == ["--check"]:
        if DOC.exists() and DOC.read_text() == text:
            return 0
        print(f"{DOC} is stale: run python -m services.settings.reference --write", file=sys.stderr)
        return 1
    if args:
        print("usage: python -m services.settings.reference [--write | --check]", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
