"""What the product metrics mean, defined once: the reward, the judge, the long-term holdout,
the demo's report and ``rtrl status`` all measure through these functions.

- **Edit persistence at a horizon**: for an accepted edit, the share of its inserted
  characters still in the file ``horizon_s`` seconds later (retained/inserted, clamped to
  [0, 1]); when that horizon was not reported, the reported horizon nearest to it (the shorter
  on a tie). Questions, empty completions and edits not accepted have none. The horizon is
  the reward spec's primary one (``[persistence] primary_horizon_s``): what training rewards
  is what the judge decides on and what the report shows.
- **The cohort summary**: per arm (or version), the mean reward, mean and p95 latency
  (linear interpolation between order statistics), acceptance among edits with
  accept/reject feedback, edit persistence over accepted edits that have one, edit and
  question rates, the share of requests with a dissatisfied follow-up, and invalid tool
  calls per tool call. NaN where a figure has no data.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

PERSISTENCE_HORIZON_S = 600
"""The default spec's primary horizon; a deployment's is its reward spec's."""


def nearest_horizon(observed: Iterable[int], horizon_s: int) -> int | None:
    """``horizon_s`` if observed, else the observed horizon nearest to it (the shorter on a
    tie); None when none was observed."""
    seen = list(observed)
    if not seen:
        return None
    return min(seen, key=lambda h: (abs(h - horizon_s), h))


def persistence_at(observed: Mapping[str, float] | Mapping[int, float], horizon_s: int) -> float | None:
    """The retained/inserted ratio at ``horizon_s`` (see :func:`nearest_horizon`), clamped to
    [0, 1]; keys are horizons in seconds (as ints or as the strings of a reward record)."""
    by_s = {int(float(h)): float(v) for h, v in observed.items()}
    h = nearest_horizon(by_s, horizon_s)
    return None if h is None else min(1.0, max(0.0, by_s[h]))


def edit_persistence(kind: str, accepted: bool | None, observed: Mapping[str, float] | None,
                     horizon_s: int) -> float | None:
    """Edit persistence of one request: only an accepted edit has one."""
    if kind != "edit" or accepted is not True or not observed:
        return None
    return persistence_at(observed, horizon_s)


class Outcome(Protocol):
    """One served request as the summary reads it (``rollback.types.RequestOutcome`` is one)."""

    @property
    def reward(self) -> float: ...
    @property
    def latency_ms(self) -> float: ...
    @property
    def persistence(self) -> float | None: ...
    @property
    def accepted(self) -> bool | None: ...
    @property
    def dissatisfied(self) -> int: ...
    @property
    def completion_kind(self) -> str: ...
    @property
    def tool_calls(self) -> int: ...
    @property
    def invalid_tool_calls(self) -> int: ...


@dataclass(frozen=True)
class Summary:
    """The cohort summary (module doc); NaN where a figure has no data."""

    n: int
    edit_persistence: float
    latency_ms: float
    latency_p95_ms: float
    reward: float
    acceptance: float
    edit_rate: float
    question_rate: float
    dissatisfied_rate: float
    n_persistence: int
    invalid_tool_rate: float = math.nan
    n_judged: int = 0
    """Edits with accept/reject feedback (the acceptance's denominator)."""


def mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def quantile(values: Iterable[float], q: float) -> float:
    """Empirical quantile (linear interpolation, numpy's default); NaN for no values. The
    judge's guardrails use it too (on arrays, taken as they are, not element by element)."""
    arr = np.asarray(values, dtype=np.float64) if isinstance(values, np.ndarray) \
        else np.fromiter(values, dtype=np.float64)
    return float(np.quantile(arr, q)) if arr.size else math.nan


def summarise(outcomes: Sequence[Outcome]) -> Summary:
    """The cohort summary of ``outcomes``."""
    persisted = [o.persistence for o in outcomes if o.persistence is not None]
    judged = [o.accepted for o in outcomes if o.completion_kind == "edit" and o.accepted is not None]
    latencies = [o.latency_ms for o in outcomes]
    calls = sum(o.tool_calls for o in outcomes)
    return Summary(
        n=len(outcomes),
        edit_persistence=mean(persisted),
        latency_ms=mean(latencies),
        latency_p95_ms=quantile(latencies, 0.95),
        reward=mean([o.reward for o in outcomes]),
        acceptance=mean([1.0 if a else 0.0 for a in judged]),
        edit_rate=mean([1.0 if o.completion_kind == "edit" else 0.0 for o in outcomes]),
        question_rate=mean([1.0 if o.completion_kind == "question" else 0.0 for o in outcomes]),
        dissatisfied_rate=mean([1.0 if o.dissatisfied else 0.0 for o in outcomes]),
        invalid_tool_rate=sum(o.invalid_tool_calls for o in outcomes) / calls if calls else math.nan,
        n_persistence=len(persisted),
        n_judged=len(judged),
    )
