"""JSON Schema validation with bounded work, for schemas written by whoever sends a request.

The maintained ``jsonschema`` library validates; three things it would let a hostile schema
do are taken away:

* **Unbounded work.** Every keyword the validator applies ticks a :class:`Budget` (a step
  count and a deadline, per request or per answer); a ``$ref`` cycle, or ``anyOf`` chains
  that branch at every level through shared ``$defs``, exhaust it and raise
  :class:`BudgetExceededError` instead of running for hours.
* **Catastrophic regular expressions.** ``pattern`` and ``patternProperties`` run on RE2
  (``google-re2``), which matches in linear time and refuses patterns it cannot run so
  (backreferences, lookaround, repetition counts over 1000); Python's ``re`` would
  backtrack exponentially on ``^(a|a)*$``.
* **Fetching remote references.** Validators get an empty ``referencing.Registry``: a
  ``$ref`` to anything outside the schema is unresolvable, never fetched.

``format`` is an annotation here (no format checker), as JSON Schema 2020-12 defaults to.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import re2
from jsonschema import (
    Draft4Validator,
    Draft6Validator,
    Draft7Validator,
    Draft201909Validator,
    Draft202012Validator,
    ValidationError,
    validators,
)
from jsonschema.protocols import Validator
from referencing import Registry

STEPS = 50_000
"""Keyword applications one budget allows (a real tool schema needs tens to hundreds)."""
SECONDS = 0.2
"""CPU time of the validating thread one budget allows. CPU time, not wall time: on a busy
machine wall time also counts other processes' turns, and a valid call must never be judged
invalid because the gateway was busy (the invalid-tool detector would roll back a healthy
candidate)."""


class BudgetExceededError(Exception):
    """Validation stopped: the schema needs more work than its budget allows."""


class Budget:
    """Keyword applications and CPU time left for one request's (or one answer's) validations."""

    def __init__(self, steps: int = STEPS, seconds: float = SECONDS) -> None:
        self.steps = steps
        self.deadline = time.thread_time() + seconds

    def tick(self) -> None:
        self.steps -= 1
        if self.steps < 0:
            raise BudgetExceededError("the schema needs more steps than the validation budget allows")
        if self.steps % 64 == 0 and time.thread_time() > self.deadline:
            raise BudgetExceededError("validating against the schema took longer than its time budget")


_BUDGET: ContextVar[Budget | None] = ContextVar("rtrl_schema_budget", default=None)


@contextmanager
def budget(b: Budget) -> Iterator[Budget]:
    """Validations inside this block spend ``b`` (none may run without a budget)."""
    token = _BUDGET.set(b)
    try:
        yield b
    finally:
        _BUDGET.reset(token)


def _tick() -> None:
    b = _BUDGET.get()
    if b is None:
        raise BudgetExceededError("schema validation outside a budget")
    b.tick()


_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False


@functools.lru_cache(maxsize=1024)
def compiled(pattern: str) -> Any:
    """The RE2 program of ``pattern``; raises ``ValueError`` naming what RE2 refuses."""
    try:
        return re2.compile(pattern, _RE2_OPTIONS)
    except re2.error as exc:
        raw = exc.args[0] if exc.args else exc
        detail = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
        raise ValueError(f"pattern {pattern[:60]!r} cannot run in linear time (RE2): {detail}") from None


def _matches(pattern: str, text: str) -> bool:
    try:
        return compiled(pattern).search(text) is not None
    except ValueError as exc:
        raise BudgetExceededError(str(exc)) from None


def _pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Iterator[ValidationError]:
    if validator.is_type(instance, "string") and not _matches(pattern, instance):
        yield ValidationError(f"{instance[:80]!r} does not match {pattern[:80]!r}")


def _pattern_properties(validator: Any, patterns: dict[str, Any], instance: Any,
                        schema: Any) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for key, value in instance.items():
            if _matches(pattern, key):
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


def _counted(keyword: Callable[..., Any]) -> Callable[..., Any]:
    def apply(validator: Any, value: Any, instance: Any, schema: Any) -> Any:
        _tick()
        return keyword(validator, value, instance, schema)
    return apply


def _bounded(cls: Any) -> Any:
    """``cls`` with every keyword counted and the regular expressions on RE2."""
    keywords = {**cls.VALIDATORS, "pattern": _pattern, "patternProperties": _pattern_properties}
    return validators.extend(cls, {name: _counted(fn) for name, fn in keywords.items()})


_DRAFTS = (Draft4Validator, Draft6Validator, Draft7Validator, Draft201909Validator, Draft202012Validator)
DRAFTS: dict[str, tuple[Any, Any]] = {
    str(cls.META_SCHEMA.get("$id", cls.META_SCHEMA.get("id", ""))).rstrip("#"): (cls, _bounded(cls))
    for cls in _DRAFTS
}
"""Meta-schema URI -> (the plain validator class, its bounded variant)."""
DEFAULT = DRAFTS[str(Draft202012Validator.META_SCHEMA["$id"]).rstrip("#")]
"""A schema without a known ``$schema`` is JSON Schema 2020-12 (what OpenAI's tools use)."""


def draft(schema: dict[str, Any]) -> tuple[Any, Any]:
    """(plain, bounded) validator classes for ``schema``'s ``$schema`` (default 2020-12)."""
    uri = schema.get("$schema")
    return DRAFTS.get(uri.rstrip("#"), DEFAULT) if isinstance(uri, str) else DEFAULT


def bounded_validator(schema: dict[str, Any]) -> Validator:
    """A validator of ``schema`` that spends the current :func:`budget` and fetches nothing."""
    _, bounded = draft(schema)
    validator: Validator = bounded(schema, registry=Registry())
    return validator


def first_error(validator: Validator, instance: Any) -> str | None:
    """Why ``instance`` does not match (the first error found), or None when it does. Raises
    :class:`BudgetExceededError` when the budget runs out, ``RecursionError`` on a schema that recurses
    without consuming the instance, and ``jsonschema``/``referencing`` errors when the schema
    cannot be applied (an unresolvable ``$ref``)."""
    error = next(iter(validator.iter_errors(instance)), None)
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path)
    return f"{'at ' + where + ': ' if where else ''}{error.message[:200]}"
