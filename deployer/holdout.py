"""The long-term holdout (pure): a pinned share of users that stays on a baseline version.

Every canary measures one step (candidate against champion). The holdout measures the loop's
*total* effect directly: a share of users, chosen by a salted hash like canary routing, keeps
being served a pinned baseline version for a set period, whatever is promoted meanwhile. The
deployer compares the champion's users with the holdout's in the same minutes, with the
judge's stratified, always-valid statistics (holdout = baseline, champion = treatment).

Assignment: a user is held out iff the holdout is active (``started_at <= now < until``) and
``bucket(user_key, salt) < round(share * 10_000)`` (deployer/routing.py). Held-out users never
see a canary; the canary's split applies to everyone else. The salt is derived from the id
of the command that pinned or rotated the holdout, so a rotation reshuffles who is held out.

The holdout lives in one Redis key beside the routing table (``{prefix}routing:holdout``, a
JSON object), so the gateway reads it in the same MGET and the deployer can end it at once.
An expired holdout routes nobody to the baseline even if no deployer runs to remove it.

Operator commands (``rtrl holdout pin|rotate|end``) reach the deployer's command queue signed
like every other manual command (deployer/operators.py); :func:`plan` is their rule table.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from deployer.actions import Action, EngineLoad, LedgerClose, LedgerOpen, SetHoldout
from deployer.cohorts import HoldoutWindow, JudgedOn, judge_window
from deployer.engine import FAILED
from deployer.ledger import CONTROLLER, TAG_DECIDED_BY, TAG_OUTCOME, TAG_REASON, clip, iso
from deployer.routing import MAX_HOLDOUT_SHARE as MAX_SHARE
from deployer.routing import Holdout, canary_buckets
from deployer.status import Command, Observations
from ingest.contracts.registry import (
    OUTCOME_RUNNING,
    TAG_CANARY_ID,
    TAG_CANDIDATE,
    TAG_DECIDED_AT,
    TAG_HOLDOUT_END,
    TAG_HOLDOUT_SHARE,
    TAG_HOLDOUT_VERSION,
    TAG_KIND,
)
from rollback.types import JudgePolicy

ID_PREFIX = "holdout-"
"""Every holdout's id (and ledger run name) starts with it."""
KINDS = ("holdout_pin", "holdout_rotate", "holdout_end")
"""Operator command kinds that act on the holdout."""
DEFAULT_SHARE = 0.05
DEFAULT_DAYS = 14.0
MAX_DAYS = 366.0
MIN_USERS = 30
"""Users on each side before the comparison has an interval: fewer than a canary's
``judge_min_users`` (a holdout is a small share and nothing is decided on it), enough for the
clustered variance and the normal approximation."""
METRICS = ("persistence", "latency_ms", "dissatisfied", "reward", "acceptance",
           "session_completion", "turns_per_completed", "session_invalid_tool_rate")
"""The judge's metrics reported for champion vs holdout (those the judge measured: the
per-session ones under a reward spec with sessions)."""


def salt_of(command_id: str) -> str:
    """The hash salt of a holdout pinned or rotated by command ``command_id``."""
    return "holdout-" + hashlib.sha256(command_id.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Request:
    """What an operator asked for (the command's fields)."""

    kind: str
    """One of ``KINDS``."""
    command_id: str
    by: str
    version: str | None = None
    share: float | None = None
    days: float | None = None
    reason: str = ""


@dataclass(frozen=True)
class Planned:
    """The outcome of one holdout command."""

    result: str
    """The line the CLI prints; starts with ``rejected:`` when nothing changes."""
    before: Holdout | None = None
    """The holdout that ended or was replaced (None: none was active)."""
    after: Holdout | None = None
    """The holdout in force afterwards (None: none)."""

    @property
    def rejected(self) -> bool:
        return self.result.startswith("rejected")


def plan(req: Request, current: Holdout | None, champion: str | None, gate: Mapping[str, str],
         now: float, holdout_id: str) -> Planned:
    """The rule table of ``rtrl holdout pin|rotate|end`` (``holdout_id`` names a new holdout).

    * pin: only when no holdout is active; the version defaults to the champion, any other
      version must have passed the gate; share in (0, 0.5] (default 5%), days in (0, 366]
      (default 14);
    * rotate: only while one is active; new salt (new users), new start, the version defaults
      to the champion of the moment, share and length default to the current holdout's;
    * end: only while one is active.
    """
    live = current if current is not None and current.active(now) else None
    if req.kind == "holdout_end":
        if live is None:
            return Planned("rejected: no holdout is active")
        return Planned(f"ended holdout {live.id} (v{live.version}, {live.share:.1%} of users)", live, None)
    if req.kind == "holdout_pin" and live is not None:
        return Planned(f"rejected: holdout {live.id} is active (v{live.version}, until "
                       f"{iso(live.until)}); rotate or end it first")
    if req.kind == "holdout_rotate" and live is None:
        return Planned("rejected: no holdout is active; pin one first")
    if req.kind not in KINDS:
        return Planned(f"rejected: unknown holdout command {req.kind!r}")
    version = req.version or champion
    if version is None:
        return Planned("rejected: no champion to pin; name a VERSION")
    if version != champion and gate.get(version) != "pass":
        return Planned(f"rejected: v{version} has gate result {gate.get(version) or 'missing'}; only the "
                       "champion or a version that passed the gate can be pinned")
    share = req.share if req.share is not None else (live.share if live else DEFAULT_SHARE)
    days = req.days if req.days is not None else ((live.until - live.started_at) / 86400.0 if live
                                                  else DEFAULT_DAYS)
    problem = _bad_share_or_days(share, days)
    if problem:
        return Planned(f"rejected: {problem}")
    new = Holdout(id=holdout_id, version=version, share=share, salt=salt_of(req.command_id),
                  started_at=now, until=now + days * 86400.0, by=req.by)
    verb = "pinned" if live is None else f"rotated {live.id} into"
    return Planned(f"{verb} {new.id}: {share:.1%} of users on v{version} until {iso(new.until)}",
                   live, new)


def _bad_share_or_days(share: float, days: float) -> str:
    if not (math.isfinite(share) and 0.0 < share <= MAX_SHARE):
        return f"share {share:g} must lie in (0, {MAX_SHARE:g}]"
    if canary_buckets(share) == 0:
        return f"share {share:g} rounds to no user (the split's resolution is 0.01%)"
    if not (math.isfinite(days) and 0.0 < days <= MAX_DAYS):
        return f"days {days:g} must lie in (0, {MAX_DAYS:g}]"
    return ""


def expired(current: Holdout | None, now: float) -> bool:
    """A holdout still written in Redis whose period is over: the deployer ends it."""
    return current is not None and now >= current.until


def holdout_id(version: str, command_id: str) -> str:
    """The holdout's id and ledger run name, fixed by the command that made it (so a tick
    retried after a failure finds the same ledger run)."""
    return f"{ID_PREFIX}v{version}-{command_id[:12]}"


# ---------------------------------------------------------------------------- in the controller
def _number(value: object) -> float | None:
    """A queued command's share or days as a float (None when absent; NaN when not a number,
    which ``plan`` rejects)."""
    if value is None:
        return None
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return math.nan


def handle(obs: Observations, cmd: Command) -> tuple[list[Action], str]:
    """Actions and result line of one verified holdout command. The ledger is written before
    the routing key, and the new holdout's id comes from the command, so a tick retried after
    a failure repeats the same writes."""
    version = cmd.version or obs.champion or "none"
    hid = holdout_id(version, cmd.id)
    if obs.holdout is not None and obs.holdout.id == hid:
        return [], f"holdout {hid} is in force (this command was applied)"
    req = Request(kind=cmd.kind, command_id=cmd.id, by=cmd.by, version=cmd.version,
                  share=_number(cmd.share), days=_number(cmd.days), reason=cmd.reason)
    p = plan(req, obs.holdout, obs.champion, obs.gate, obs.now, hid)
    if p.rejected:
        return [], p.result
    actions: list[Action] = []
    if p.after is not None and obs.engine is not None:  # loaded and checked before any traffic
        state = obs.engine.get(p.after.version)
        if state is not None and state.state == FAILED:
            return [], f"rejected: v{p.after.version} cannot be served by the engine: {state.reason}"
        actions.append(EngineLoad(p.after.version, required=True))
    said = f" by {cmd.by}" + (f": {cmd.reason}" if cmd.reason else "")
    if p.before is not None:
        word = "ended" if p.after is None else f"rotated into {p.after.id}"
        actions += close(p.before, obs.now, f"{word}{said}", cmd.by)
    elif obs.holdout is not None:  # an expired one the controller has not ended yet
        actions += close(obs.holdout, obs.now, f"expired at {iso(obs.holdout.until)}", CONTROLLER)
    if p.after is not None:
        actions.append(LedgerOpen(p.after.id, open_params(p.after), open_tags(p.after, f"pinned{said}"),
                                  obs.now))
    actions.append(SetHoldout(p.after))
    return actions, p.result


def upkeep(obs: Observations, actions: list[Action]) -> list[Action]:
    """Every tick: end a holdout whose period is over (ledger first, then the routing key),
    unless a command of this tick (in ``actions``) already set the holdout."""
    h = obs.holdout
    if h is None or not expired(h, obs.now) or any(isinstance(a, SetHoldout) for a in actions):
        return []
    return [*close(h, obs.now, f"expired at {iso(h.until)}", CONTROLLER), SetHoldout(None)]


# ---------------------------------------------------------------------------- the ledger
KIND = "holdout"
"""``rtrl.canary.kind`` of a holdout's ledger run."""


def open_params(h: Holdout) -> dict[str, str]:
    return {"holdout_version": h.version, "share": f"{h.share:g}", "salt": h.salt,
            "started_at": iso(h.started_at), "until": iso(h.until)}


def open_tags(h: Holdout, reason: str) -> dict[str, str]:
    return {TAG_CANARY_ID: h.id, TAG_KIND: KIND, TAG_CANDIDATE: h.version, TAG_HOLDOUT_VERSION: h.version,
            TAG_HOLDOUT_SHARE: f"{h.share:g}", TAG_OUTCOME: OUTCOME_RUNNING, TAG_REASON: clip(reason)}


def close(h: Holdout, now: float, reason: str, by: str) -> list[Action]:
    """Ledger actions that end ``h``'s run (opening it first when it was never recorded)."""
    tags = {TAG_OUTCOME: "ended", TAG_HOLDOUT_END: clip(reason), TAG_DECIDED_BY: by, TAG_DECIDED_AT: iso(now),
            TAG_KIND: KIND}
    summary = {"holdout_id": h.id, "version": h.version, "share": h.share, "salt": h.salt,
               "started_at": iso(h.started_at), "until": iso(h.until), "ended_at": iso(now),
               "ended": reason, "by": by}
    return [LedgerOpen(h.id, open_params(h), open_tags(h, "pinned (recorded when it ended)"), h.started_at),
            LedgerClose(h.id, now, tags, summary)]


PANELS: tuple[tuple[str, tuple[str, ...]], ...] = tuple(
    (title, (f"holdout.{m}.holdout_mean", f"holdout.{m}.champion_mean"))
    for title, m in (("persistence", "persistence"), ("latency mean (ms)", "latency_ms"),
                     ("dissatisfied follow-ups", "dissatisfied"), ("reward (mean)", "reward"))
)
"""The ledger plot of a holdout run: both sides of each metric over its measurements."""


def description(tags: Mapping[str, str], metrics: Mapping[str, float]) -> str:
    """Markdown for a holdout's ledger run: what was held out, and the latest effect."""
    version, share = tags.get(TAG_HOLDOUT_VERSION, "?"), tags.get(TAG_HOLDOUT_SHARE, "?")
    lines = [f"**Long-term holdout: {share} of users kept on v{version}.**", ""]
    if tags.get(TAG_HOLDOUT_END):
        lines += [f"Ended: {tags[TAG_HOLDOUT_END]} (by {tags.get(TAG_DECIDED_BY, '?')}).", ""]
    found = sorted({k.split(".")[1] for k in metrics if k.startswith("holdout.")})
    if not found:
        return "\n".join([*lines, "Not measured yet."]) + "\n"
    lines += ["The champion against the holdout, latest measurement (champion − holdout, "
              "always-valid interval):", ""]
    for m in found:
        def get(stat: str, m: str = m) -> float:
            return metrics.get(f"holdout.{m}.{stat}", math.nan)

        rel = get("relative")
        change = "" if math.isnan(rel) else f"{rel:+.1%}, "
        lines.append(f"- {m}: {get('holdout_mean'):.4g} → {get('champion_mean'):.4g} ({change}interval "
                     f"[{get('lower'):.4g}, {get('upper'):.4g}]; {get('users_champion'):.0f} vs "
                     f"{get('users_holdout'):.0f} users)")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- the effect
@dataclass(frozen=True)
class Effect:
    """Champion minus holdout for one metric, with the judge's always-valid interval."""

    metric: str
    holdout_mean: float
    champion_mean: float
    estimate: float
    lower: float
    upper: float
    users_holdout: int
    users_champion: int

    @property
    def relative(self) -> float:
        """estimate / |holdout mean|: its sign is the change's direction, also on a negative
        baseline (a reward rising from -1.5 to -1.1 is +27%, not -27%); NaN when the holdout's
        mean is 0."""
        return self.estimate / abs(self.holdout_mean) if self.holdout_mean else math.nan


def comparison_policy(policy: JudgePolicy) -> JudgePolicy:
    """The judge's policy for champion vs holdout: the canary's, with intervals from
    ``MIN_USERS`` users per side."""
    return replace(policy, min_users=min(policy.min_users, MIN_USERS))


@dataclass(frozen=True)
class Measured:
    """One comparison of the champion against the holdout."""

    effects: list[Effect]
    level: float
    """Confidence level of the intervals (two-sided, per test)."""
    users_holdout: int
    users_champion: int


def measure(window: HoldoutWindow, policy: JudgePolicy, now: float) -> Measured:
    """The champion against the holdout over ``window`` until ``now``: the judge on the
    window's two sides (holdout as stable), time strata from the window's start, with
    :func:`comparison_policy`. Shared by the deployer and the demo report."""
    policy = comparison_policy(policy)
    verdict, base, champ = judge_window(window, policy, JudgedOn(window.started_at, now))
    level = 1.0 - 2.0 * policy.alpha_per_test()
    return Measured(effects(verdict.metrics), level, base.users(), champ.users())


def effects(evidence: Any) -> list[Effect]:
    """Effects from the judge's ``Verdict.evidence`` (holdout judged as stable, champion as canary),
    for the metrics in ``METRICS`` that have data on both sides."""
    out = []
    for e in evidence:
        if e.metric not in METRICS or e.status == "insufficient":
            continue
        values = (e.stable_mean, e.canary_mean, e.estimate, e.ci_lower, e.ci_upper)
        if not all(math.isfinite(v) for v in values[:3]):
            continue
        out.append(Effect(e.metric, *values, users_holdout=e.n_stable, users_champion=e.n_canary))
    return out


def report(h: Holdout, champion: str, since: float, now: float, found: list[Effect], level: float
           ) -> dict[str, Any]:
    """The holdout's state for ``rtrl status``, metrics and the ledger (JSON-safe)."""
    return {
        "holdout_id": h.id, "version": h.version, "share": h.share, "until": h.until,
        "champion": champion, "since": since, "at": now, "level": level, "effects": effects_doc(found),
    }


def effects_doc(found: list[Effect]) -> dict[str, dict[str, Any]]:
    """metric -> its figures, JSON-safe (an undefined bound or ratio is null)."""
    return {e.metric: {"holdout": _finite(e.holdout_mean), "champion": _finite(e.champion_mean),
                       "estimate": _finite(e.estimate), "lower": _finite(e.lower), "upper": _finite(e.upper),
                       "relative": _finite(e.relative), "users_holdout": e.users_holdout,
                       "users_champion": e.users_champion} for e in found}


def _finite(value: float) -> float | None:
    """Strict JSON: an unbounded interval or undefined ratio is null."""
    return value if math.isfinite(value) else None


def step_metrics(found: list[Effect]) -> dict[str, float]:
    """Ledger metrics of one measurement: ``holdout.<metric>.<figure>`` (finite values only)."""
    out: dict[str, float] = {}
    for e in found:
        for name, value in (("holdout_mean", e.holdout_mean), ("champion_mean", e.champion_mean),
                            ("estimate", e.estimate), ("lower", e.lower), ("upper", e.upper),
                            ("relative", e.relative), ("users_holdout", float(e.users_holdout)),
                            ("users_champion", float(e.users_champion))):
            if math.isfinite(value):
                out[f"holdout.{e.metric}.{name}"] = float(value)
    return out
