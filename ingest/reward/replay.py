"""Replay: the rewards past requests would have had under another reward spec.

Input: the events of the events topic, each with the time the broker appended it, and the
live reward records of the rewards topic. For every request with a live record, its window is
rebuilt with the same join (:func:`ingest.reward.join.apply`) from its events appended at or
before the record's ``closed_ts`` (the live worker cannot have applied a later one: it reads an
event only after the broker appended it) and closed at that same time under the new spec
(:func:`ingest.reward.join.close`). The windows are the live ones, so only the reward
function changes: a spec with other horizons sees only the persistence reports the live
window had.

Given the live spec, the replay reproduces the live records exactly, except where the live
worker lagged (an event appended before the close but read after it was *late* there and is
included here). :func:`replay` therefore always replays under the live spec too when asked
(``check``) and counts the records it does not reproduce.

Requests without a live record (still open, or orphans) are counted, not replayed. Every
replayed record carries the new spec's ``reward_spec_version``.

Under a spec with a ``[session]`` table the replay credits sessions as the worker's session
stage does (:func:`credit_sessions`): every session is assembled from all its events in range;
a request is a turn of the first session whose ``session.turn`` claimed it (in append order);
each session's served turns with a live record get the session credit from the facts of their
rebuilt windows. A session without an end counts as timed out (its turns have live records, so
it closed). A live record made per request where the replay credits a session (a
``session.turn`` the live worker saw only after its request's record was out) is the one case
the check reports as not reproduced.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

from ingest.events import Event, RewardRecord, SessionEvent, SessionTurn
from ingest.reward.join import Window, apply, close
from ingest.reward.session_credit import credit
from ingest.reward.session_stage import credited_sessions, note_facts
from ingest.reward.sessions import assemble_all
from ingest.reward.spec import RewardSpec


@dataclass(frozen=True)
class Pair:
    live: RewardRecord
    replayed: RewardRecord


@dataclass
class ReplayResult:
    pairs: list[Pair] = field(default_factory=list)
    without_live_record: int = 0
    """Events of requests with no live record in range (open windows, orphans)."""
    after_close: int = 0
    """Events appended after their request's live close (late there too)."""
    missing_served: int = 0
    """Live records whose served event was not found among the events (out of range)."""


def rebuild(events: Iterable[tuple[float, Event]], live: Mapping[str, RewardRecord], spec: RewardSpec,
            ) -> tuple[dict[str, Window], ReplayResult]:
    """The live windows rebuilt from ``(append time, event)`` pairs, in append order."""
    result = ReplayResult()
    windows: dict[str, Window] = {}
    for ts, ev in sorted(events, key=lambda te: te[0]):
        rec = live.get(ev.request_id)
        if rec is None:
            result.without_live_record += 1
            continue
        if ts > rec.closed_ts.timestamp():
            result.after_close += 1
            continue
        windows[ev.request_id] = apply(windows.get(ev.request_id), ev, ts, spec)
    return windows, result


def replay(events: Sequence[tuple[float, Event]], live_records: Iterable[RewardRecord],
           spec: RewardSpec) -> ReplayResult:
    """Every live record next to its replay under ``spec`` (in the live records' order)."""
    live = {r.request_id: r for r in live_records}
    windows, result = rebuild(events, live, spec)
    replayed: dict[str, RewardRecord] = {}
    for rid, rec in live.items():
        w = windows.get(rid)
        if w is None or w.served is None:
            result.missing_served += 1
            continue
        out = close(w, spec, rec.closed_ts.timestamp()).record
        assert out is not None  # a window with its served event always closes to a record
        replayed[rid] = out
    if spec.session is not None:
        replayed.update(credit_sessions(events, windows, replayed, spec))
    result.pairs += [Pair(live[rid], rec) for rid, rec in replayed.items()]
    return result


def credit_sessions(events: Sequence[tuple[float, Event]], windows: Mapping[str, Window],
                    records: Mapping[str, RewardRecord], spec: RewardSpec) -> dict[str, RewardRecord]:
    """The session-credited records of the requests that are turns (module doc), by request id."""
    assert spec.session is not None
    session_events = [ev for _, ev in sorted(events, key=lambda te: te[0]) if isinstance(ev, SessionEvent)]
    owner: dict[str, str] = {}
    for ev in session_events:
        if isinstance(ev, SessionTurn):
            owner.setdefault(ev.request_id, ev.session_id)
    if not session_events:
        return {}
    far = max(ev.ts for ev in session_events) + timedelta(seconds=spec.session.idle_s + spec.session.max_s)
    out: dict[str, RewardRecord] = {}
    for sid, session in assemble_all(session_events, far, spec.session.window).items():
        facts = {}
        for t in session.turns:
            w = windows.get(t.request_id)
            f = None if w is None or owner.get(t.request_id) != sid else note_facts(w, spec)
            if f is not None and t.request_id in records:
                facts[t.request_id] = f.facts()
        about_all = credited_sessions(session, facts)
        for c, about in zip(credit(session, facts, spec.session), about_all, strict=True):
            out[c.request_id] = records[c.request_id].model_copy(update={
                "reward": c.reward, "components": dict(c.components), "defaulted": False,
                "session_credit": about})
    return out



def reproduced(pair: Pair) -> bool:
    """The replay under the live spec gave the live record (the whole record, not only the
    reward)."""
    return pair.live.model_dump() == pair.replayed.model_dump()


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _sign(x: float, eps: float = 1e-12) -> int:
    return 0 if abs(x) <= eps else (1 if x > 0 else -1)


def summarize(pairs: Sequence[Pair]) -> dict[str, object]:
    """How the rewards change: overall and per (version, arm)."""
    live = [p.live.reward for p in pairs]
    new = [p.replayed.reward for p in pairs]
    groups: dict[tuple[str, str], list[Pair]] = {}
    for p in pairs:
        groups.setdefault((p.live.model.version, p.live.arm), []).append(p)
    return {
        "records": len(pairs),
        "changed": sum(1 for a, b in zip(live, new, strict=True) if abs(a - b) > 1e-12),
        "sign_flips": sum(1 for a, b in zip(live, new, strict=True) if _sign(a) != _sign(b)),
        "mean_live": _mean(live),
        "mean_replayed": _mean(new),
        "mean_abs_change": _mean([abs(a - b) for a, b in zip(live, new, strict=True)]),
        "by_version_arm": [
            {"version": v, "arm": arm, "records": len(ps), "mean_live": _mean([p.live.reward for p in ps]),
             "mean_replayed": _mean([p.replayed.reward for p in ps])}
            for (v, arm), ps in sorted(groups.items())
        ],
    }


def advantage_shift(live: Sequence[float], new: Sequence[float]) -> dict[str, float]:
    """How the advantages of the same records (same groups) change: mean absolute change and
    the share whose sign flips, i.e. which completions the trainer would push up instead of
    down or the other way round."""
    flips = sum(1 for a, b in zip(live, new, strict=True) if _sign(a, 1e-9) != _sign(b, 1e-9))
    return {"mean_abs_change": _mean([abs(a - b) for a, b in zip(live, new, strict=True)]),
            "sign_flip_share": flips / len(live) if live else float("nan")}
