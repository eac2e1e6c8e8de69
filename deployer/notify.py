"""Decision notifications (pure): which ticks announce a decision, the bodies a webhook
receives, their signature and the retry schedule. deployer/adapters/webhook.py delivers them.

A notice goes out when a tick ends a canary: promoted, rolled back (by the judge, a
guardrail, a detector or an operator; also a champion restored by hand) or aborted; and
when a canary that passed the judge starts waiting for an operator's approval (with the
approval gate on: ``rtrl approve`` promotes it, ``rtrl rollback`` rejects it).

Bodies:

- ``json``: one object, ``{"event": "rtrl.canary.decision", "outcome": "rolled_back", ...}``
  (see :func:`json_payload`);
- ``slack``: ``{"text": "..."}``, what Slack's (and Mattermost's, Teams' workflow) incoming
  webhooks accept.

With a secret, every request carries ``X-Rtrl-Signature: sha256=<hex>``: the HMAC-SHA256 of
the exact body bytes under the secret, as GitHub signs its webhooks.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Literal, Protocol

from deployer.ledger import DECISION_OF, iso
from deployer.status import CanaryStatus, Phase
from ingest import auth as hmac_auth

EVENT = "rtrl.canary.decision"
SIGNATURE_HEADER = "X-Rtrl-Signature"
Format = Literal["json", "slack"]
DECIDED = frozenset({Phase.SUCCEEDED, Phase.ROLLED_BACK, Phase.ABORTED})
"""Phases a decision ends in."""

WAITING = "awaiting_approval"
"""The notice's outcome when a canary starts waiting for approval (no decision yet)."""

HEADLINE = {
    WAITING: "v{candidate} passed the judge and waits for approval (rtrl approve {candidate})",
    "promoted": "promoted v{candidate} to champion (was v{stable})",
    "rolled_back": "rolled back v{candidate}; v{stable} stays champion",
    "aborted": "aborted the canary of v{candidate}; v{stable} stays champion",
}
RESTORE = "restored v{candidate} as champion (v{stable} rolled back)"
"""A champion rolled back by hand to an older version."""
ICON = {"promoted": ":white_check_mark:", "rolled_back": ":rotating_light:", "aborted": ":warning:",
        WAITING: ":hourglass:"}


@dataclass(frozen=True)
class Notice:
    """One decision, as the receivers see it."""

    outcome: str
    """promoted | rolled_back | aborted | awaiting_approval"""
    canary_id: str
    kind: str
    """canary | manual_promote | manual_rollback"""
    candidate: str
    stable: str
    reason: str
    decided_by: str
    decided_at: str
    """UTC, ISO 8601."""
    model: str = ""
    """The registered model's name."""
    links: Mapping[str, str] = field(default_factory=dict)
    """Named URLs, e.g. the ledger run and the model version in the MLflow UI."""


class NotifyPort(Protocol):
    """Where the controller hands a decision; ``send`` never blocks and never raises."""

    def send(self, notice: Notice) -> None: ...


def notice_of(before: CanaryStatus, after: CanaryStatus, ts: float, model: str = "",
              ui_url: str | None = None) -> Notice | None:
    """The decision this tick made, or None when it made none (a resting phase reached from
    another phase or by another canary; a replayed tick that changed nothing makes none).
    With the MLflow UI's address, the notice links the candidate's version page (whose
    description links the ledger run and the training run)."""
    waiting = after.phase == Phase.AWAITING_APPROVAL
    if not waiting and (after.phase not in DECIDED or after.outcome not in DECISION_OF):
        return None
    if (after.phase, after.canary_id) == (before.phase, before.canary_id):
        return None
    return Notice(
        outcome=WAITING if waiting else after.outcome or "", canary_id=after.canary_id or "", kind=after.kind,
        candidate=after.candidate or "", stable=after.stable or "", reason=after.reason,
        decided_by=after.decided_by or "controller", decided_at=iso(ts), model=model,
        links=version_links(ui_url, model, after.candidate, after.stable),
    )


def version_links(ui_url: str | None, model: str, candidate: str | None, stable: str | None
                  ) -> dict[str, str]:
    """``{"v7 in MLflow": "<ui>/#/models/<model>/versions/7", ...}`` (empty without an address)."""
    if not ui_url or not model:
        return {}
    base = ui_url.rstrip("/")
    return {f"v{v} in MLflow": f"{base}/#/models/{model}/versions/{v}" for v in (candidate, stable) if v}


def headline(n: Notice) -> str:
    """The decision in a few words, e.g. ``rolled back v7; v6 stays champion``."""
    template = RESTORE if n.kind == "manual_rollback" else HEADLINE[n.outcome]
    return template.format(candidate=n.candidate, stable=n.stable or "-")


def json_payload(n: Notice) -> dict[str, object]:
    return {"event": EVENT, "decision": DECISION_OF.get(n.outcome, "wait"), "summary": headline(n),
            **asdict(n),
            "links": dict(n.links)}


def slack_text(n: Notice) -> str:
    model = f"{n.model} " if n.model else ""
    lines = [f"{ICON[n.outcome]} *rtrl {model}{headline(n)}*",
             f"decided by {n.decided_by} at {n.decided_at} ({n.canary_id})"]
    if n.reason:
        lines.append(f"> {n.reason}")
    lines += [f"<{url}|{name}>" for name, url in n.links.items()]
    return "\n".join(lines)


def body(n: Notice, fmt: Format) -> bytes:
    """The request body for a receiver of format ``fmt``."""
    payload: object = {"text": slack_text(n)} if fmt == "slack" else json_payload(n)
    return json.dumps(payload, separators=(",", ":"), sort_keys=True).encode()


def signature(secret: bytes, data: bytes) -> str:
    """The ``X-Rtrl-Signature`` value: ``sha256=<hex HMAC-SHA256 of the body>``."""
    return "sha256=" + hmac_auth.sign(data, secret)


def verify(secret: bytes, data: bytes, header: str) -> bool:
    """What a receiver does: recompute and compare in constant time."""
    return hmac.compare_digest(signature(secret, data), header)


def backoff_s(attempt: int, base_s: float, cap_s: float = 60.0) -> float:
    """Wait before retry ``attempt`` (1, 2, ...): ``base_s`` doubling, at most ``cap_s``."""
    return float(min(cap_s, base_s * 2 ** (attempt - 1)))


def retryable(status: int | None) -> bool:
    """A connection error or timeout (None), 408, 429 or a 5xx is worth retrying; another 4xx
    means the request itself is refused (wrong URL, bad signature) and will be again."""
    return status is None or status in (408, 429) or status >= 500
