"""An arm's request outcomes as columns: what the judge computes on.

Every metric of the judge is a vector operation over per-request values (a user index, a
serving time, the reward, the latency, ...). Taking them one ``RequestOutcome`` at a time
in Python each tick costs about 4 µs per request, 4 s at a million requests; as columns the
same tick is a few numpy passes. :class:`ColumnBuilder` keeps the columns of a growing
window (the deployer's canary window appends each record once, when it arrives) in arrays
that double when full, so a tick pays for its new records only, plus the vector passes.
`columns_from` builds them at once for callers that have only outcomes.

:func:`metric_values` gives each named metric's per-request values from the columns; it must
agree with ``rollback.metrics.METRICS``, the plain per-outcome definition
(tests/unit/test_judge_columns.py checks they do, value for value).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from ingest.contracts.metrics import PERSISTENCE_HORIZON_S, edit_persistence
from rollback.types import Columns, RequestOutcome

if TYPE_CHECKING:
    from ingest.events import RewardRecord

KINDS = ("edit", "question", "empty", "tool_call")
"""Completion kinds by code; any other kind is code ``len(KINDS)``."""
_KIND_CODE = {k: i for i, k in enumerate(KINDS)}

FLOATS = ("ts", "reward", "latency_ms", "persistence", "accepted", "dissatisfied", "tool_calls",
          "invalid_tool_calls", "completion_tokens", "session", "session_completed", "completed_turns",
          "session_broken")
"""The float columns (``persistence``/``accepted`` are 0 where ``has_*`` is False). The session
columns are 0 except at a session's lead request: ``session`` 1, ``session_completed`` 1 when
it completed, ``completed_turns`` its turns when it completed, ``session_broken`` 1 when it made
an invalid tool call."""
BOOLS = ("has_persistence", "has_accepted", "error")


def outcome_from_reward(record: RewardRecord, horizon_s: int = PERSISTENCE_HORIZON_S) -> RequestOutcome:
    """Build a RequestOutcome from a closed reward record, its edit persistence at
    ``horizon_s`` (``ingest.contracts.metrics.edit_persistence``: accepted edits only, the
    nearest reported horizon when that one is missing)."""
    persistence = edit_persistence(record.completion_kind, record.accepted, record.persistence, horizon_s)
    sc = record.session_credit if record.session_credit is not None and record.session_credit.lead else None
    return RequestOutcome(
        user_key=record.user_key,
        reward=record.reward,
        latency_ms=record.latency_ms,
        persistence=persistence,
        accepted=record.accepted,
        dissatisfied=record.dissatisfied,
        completion_kind=record.completion_kind,
        tool_calls=record.tool_calls,
        invalid_tool_calls=record.invalid_tool_calls,
        completion_tokens=len(record.completion_tokens),
        session_turns=sc.turns if sc is not None else 0,
        session_completed=sc is not None and sc.status == "completed",
        session_invalid=sc is not None and sc.invalid_tool_calls > 0,
        ts=record.served_ts.timestamp(),
    )


def columns_from(outcomes: Iterable[RequestOutcome]) -> Columns:
    """The columns of ``outcomes``, built at once."""
    b = ColumnBuilder()
    for o in outcomes:
        b.add(o)
    return b.columns()


def _row(o: RequestOutcome) -> tuple[float, ...]:
    """The float columns of one outcome, in ``FLOATS`` order."""
    return (o.ts, o.reward, o.latency_ms, 0.0 if o.persistence is None else o.persistence,
            float(bool(o.accepted)), float(o.dissatisfied > 0), float(o.tool_calls),
            float(o.invalid_tool_calls), float(o.completion_tokens), float(o.session_turns > 0),
            float(o.session_completed), float(o.session_turns) if o.session_completed else 0.0,
            float(o.session_invalid))


class ColumnBuilder:
    """Columns of a growing list of outcomes: :meth:`add` one at a time, :meth:`columns` a
    view of all so far (no copy; later additions do not change a view already taken)."""

    def __init__(self, capacity: int = 1024) -> None:
        self._n = 0
        self._ids: dict[str, int] = {}
        self._keys: list[str] = []
        self._user = np.empty(capacity, dtype=np.int64)
        self._kind = np.empty(capacity, dtype=np.int8)
        self._floats = np.empty((len(FLOATS), capacity), dtype=np.float64)  # a row per column:
        self._bools = np.empty((len(BOOLS), capacity), dtype=np.bool_)  # each column contiguous
        self._pending: list[RequestOutcome] = []

    def __len__(self) -> int:
        return self._n + len(self._pending)

    def add(self, outcome: RequestOutcome) -> None:
        self._pending.append(outcome)

    def _grow(self, need: int) -> None:
        cap = int(self._user.size)
        if need <= cap:
            return
        while cap < need:
            cap *= 2
        n = self._n
        for name in ("_user", "_kind", "_floats", "_bools"):
            old = getattr(self, name)
            new = np.empty((*old.shape[:-1], cap), dtype=old.dtype)
            new[..., :n] = old[..., :n]
            setattr(self, name, new)

    def _flush(self) -> None:
        """Write the pending outcomes into the arrays (one vector write per column)."""
        todo, self._pending = self._pending, []
        if not todo:
            return
        n, k = self._n, len(todo)
        self._grow(n + k)
        ids, keys = self._ids, self._keys
        for o in todo:
            if o.user_key not in ids:
                ids[o.user_key] = len(keys)
                keys.append(o.user_key)
        self._user[n:n + k] = [ids[o.user_key] for o in todo]
        other = len(KINDS)
        self._kind[n:n + k] = [_KIND_CODE.get(o.completion_kind, other) for o in todo]
        self._floats[:, n:n + k] = np.asarray([_row(o) for o in todo], dtype=np.float64).T
        self._bools[:, n:n + k] = np.asarray(
            [(o.persistence is not None, o.accepted is not None, o.error) for o in todo], dtype=np.bool_).T
        self._n = n + k

    def columns(self) -> Columns:
        self._flush()
        n = self._n
        fl = {name: self._floats[i, :n] for i, name in enumerate(FLOATS)}
        bo = {name: self._bools[i, :n] for i, name in enumerate(BOOLS)}
        return Columns(user=self._user[:n], user_keys=tuple(self._keys), kind=self._kind[:n],
                       **fl, **bo)  # type: ignore[arg-type]


RATE_KIND = {"edit_rate": "edit", "question_rate": "question", "abstention_rate": "empty"}
"""Metrics that are the share of one completion kind."""

Values = tuple[NDArray[np.float64], NDArray[np.bool_] | None]
"""A metric's per-request values and which requests count (None: all)."""


def metric_values(c: Columns, name: str) -> Values:
    """The per-request values of a metric of ``rollback.metrics.METRICS``; raises ``KeyError``
    for any other name."""
    if name == "persistence":
        return c.persistence, c.has_persistence
    if name == "acceptance":
        return c.accepted, c.has_accepted
    if name in RATE_KIND:
        code = _KIND_CODE[RATE_KIND[name]]
        return (c.kind == code).astype(np.float64), None
    column = {"reward": c.reward, "latency_ms": c.latency_ms, "dissatisfied": c.dissatisfied,
              "completion_length": c.completion_tokens}[name]
    return column, None


SESSION_RATIOS = {
    "session_completion": ("session_completed", "session"),
    "turns_per_completed": ("completed_turns", "session_completed"),
    "session_invalid_tool_rate": ("session_broken", "session"),
}
"""The per-session metrics, each a ratio of two columns summed per user (numerator,
denominator): completed sessions / sessions, turns of completed sessions / completed
sessions, sessions with an invalid tool call / sessions."""


def session_ratio(c: Columns, name: str) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """A per-session metric's numerator and denominator columns (``KeyError`` for another name)."""
    num, den = SESSION_RATIOS[name]
    return getattr(c, num), getattr(c, den)
