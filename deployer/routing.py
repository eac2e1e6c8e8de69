"""Traffic routing: which arm serves a user, and the routing table the deployer writes.

Every ``user_key`` falls into one of ``BUCKETS`` buckets by a salted hash::

    bucket = int.from_bytes(sha256((salt + user_key).encode("utf-8")).digest()[:8], "big") % 10_000

and is routed to the canary iff ``bucket < round(canary_weight * 10_000)`` (rounded so
that a weight of 0.05 means exactly 500 buckets, not 501 through float error). So the
assignment is

* **sticky**: the same user, salt and weight always give the same arm;
* **monotone**: raising the weight only moves users from stable to canary (never back),
  lowering it only moves them back, because the threshold is a single cut-off;
* **re-randomised per canary**: a new salt reshuffles who lands in the first percent, so the
  same users are not the guinea pigs of every canary.

A long-term holdout (deployer/holdout.py) takes its users out first, by its own salt: they are
served the pinned version and never see a canary.

Anything that needs to know a user's arm (the gateway, a simulator, an analysis notebook)
can recompute it from these two functions and the salt in Redis.

The table lives in Redis under ``{prefix}routing:*`` (``ingest.contracts.keys.routing_keys``);
the deployer writes it, the gateway reads it. ``parse_table`` turns the raw Redis values into a
:class:`RoutingTable` without trusting them: a missing, unparsable or out-of-range weight
routes nobody to the canary rather than everybody.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Literal

Arm = Literal["stable", "canary", "holdout"]
BUCKETS = 10_000
"""Resolution of the split: weights are effective in steps of 1/10_000 (0.01%)."""

MAX_HOLDOUT_SHARE = 0.5
"""At most half the users are held out: the champion keeps the larger arm."""


def bucket(user_key: str, salt: str) -> int:
    """The user's bucket in ``[0, BUCKETS)``: first 8 bytes of sha256(salt + user_key)."""
    digest = hashlib.sha256((salt + user_key).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % BUCKETS


def clamp_weight(weight: float) -> float:
    """A usable canary weight: NaN -> 0, clipped to [0, 1]."""
    if math.isnan(weight):
        return 0.0
    return min(1.0, max(0.0, weight))


def canary_buckets(canary_weight: float) -> int:
    """How many of the ``BUCKETS`` buckets go to the canary: ``round(weight * BUCKETS)``."""
    return round(clamp_weight(canary_weight) * BUCKETS)


def assign_arm(user_key: str, salt: str, canary_weight: float) -> Arm:
    """``canary`` iff the user's bucket falls under ``canary_buckets(canary_weight)``.

    A weight of 0 sends nobody to the canary, 1 sends everybody; weights outside [0, 1]
    are clipped and NaN counts as 0.
    """
    return "canary" if bucket(user_key, salt) < canary_buckets(canary_weight) else "stable"


@dataclass(frozen=True)
class Holdout:
    """One pinned holdout, as written to ``{prefix}routing:holdout``."""

    id: str
    """``holdout-v<version>-<UTC stamp>``: also the name of its ledger run."""
    version: str
    """The pinned baseline version its users are served."""
    share: float
    """Share of all users held out, in (0, MAX_HOLDOUT_SHARE]."""
    salt: str
    """Salt of the sticky hash (independent of the canary's)."""
    started_at: float
    until: float
    """Unix seconds: the holdout routes users in [started_at, until)."""
    by: str = ""
    """Who pinned or last rotated it."""

    def active(self, now: float) -> bool:
        return self.started_at <= now < self.until

    def holds(self, user_key: str, now: float) -> bool:
        """Whether ``user_key`` is held out at ``now``."""
        return self.active(now) and bucket(user_key, self.salt) < canary_buckets(self.share)

    def to_text(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def parse_holdout(raw: bytes | str | None) -> tuple[Holdout | None, str]:
    """The holdout in a raw Redis value, and what was wrong with it ('' when nothing).

    A missing value is no holdout. A value that does not parse, or whose share or times make
    no sense, is *no holdout* too (never "everyone held out"), with the problem reported."""
    if raw is None:
        return None, ""
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    if not text.strip():
        return None, ""
    try:
        data = json.loads(text)
        h = Holdout(id=str(data["id"]), version=str(data["version"]), share=float(data["share"]),
                    salt=str(data["salt"]), started_at=float(data["started_at"]),
                    until=float(data["until"]), by=str(data.get("by", "")))
    except (ValueError, TypeError, KeyError) as exc:
        return None, f"holdout {text[:80]!r} is unreadable ({type(exc).__name__}: {exc}); ignoring it"
    if not (math.isfinite(h.share) and 0.0 < h.share <= MAX_HOLDOUT_SHARE):
        return None, f"holdout share {h.share!r} is outside (0, {MAX_HOLDOUT_SHARE}]; ignoring the holdout"
    if not (math.isfinite(h.started_at) and math.isfinite(h.until) and h.until > h.started_at):
        return None, "holdout period is empty or not finite; ignoring the holdout"
    if not h.version or not h.salt:
        return None, "holdout has no version or salt; ignoring it"
    return h, ""



@dataclass(frozen=True)
class RoutingTable:
    """The traffic split as the deployer last wrote it."""

    canary_weight: float = 0.0
    """Share of users routed to the canary, in [0, 1]."""
    salt: str = ""
    """Per-canary salt of the sticky hash."""
    stable_version: str | None = None
    """Model version serving the stable arm; None: use the registry's ``champion`` alias."""
    canary_version: str | None = None
    """Model version under canary; None: no canary, everybody is on stable."""
    holdout: Holdout | None = None
    """The long-term holdout (deployer/holdout.py); None: nobody is held out."""
    problems: tuple[str, ...] = ()
    """What was wrong with the raw values (logged and counted by the reader)."""

    def arm_for(self, user_key: str, canary_available: bool, holdout_available: bool = False,
                now: float | None = None) -> Arm:
        """The arm serving ``user_key`` given whether the canary and holdout models are loaded.

        A held-out user gets the holdout arm (or stable while its version is not loaded), never
        the canary; everyone else is split between stable and canary."""
        h = self.holdout
        if h is not None and h.holds(user_key, time.time() if now is None else now):
            return "holdout" if holdout_available else "stable"
        if not canary_available or self.canary_version is None:
            return "stable"
        return assign_arm(user_key, self.salt, self.canary_weight)


def _text(raw: bytes | str | None) -> str | None:
    if raw is None:
        return None
    value = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    value = value.strip()
    return value or None


def parse_table(raw: Mapping[str, bytes | str | None]) -> RoutingTable:
    """Build a table from raw Redis values keyed by field name (``ROUTING_FIELDS``).

    Missing keys mean: weight 0, empty salt, stable = champion alias, no canary. A weight
    that does not parse, is NaN/infinite or lies outside [0, 1] is treated as 0 (never as
    "everyone on the canary") and reported in ``problems``.
    """
    problems: list[str] = []
    weight = 0.0
    text = _text(raw.get("canary_weight"))
    if text is not None:
        try:
            value = float(text)
        except ValueError:
            problems.append(f"canary_weight {text!r} is not a number; using 0")
        else:
            if not math.isfinite(value) or not 0.0 <= value <= 1.0:
                problems.append(f"canary_weight {text!r} is outside [0, 1]; using 0")
            else:
                weight = value
    holdout, problem = parse_holdout(raw.get("holdout"))
    if problem:
        problems.append(problem)
    return RoutingTable(
        canary_weight=weight,
        salt=_text(raw.get("salt")) or "",
        stable_version=_text(raw.get("stable_version")),
        canary_version=_text(raw.get("canary_version")),
        holdout=holdout,
        problems=tuple(problems),
    )
