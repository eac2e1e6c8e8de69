"""Who may decide by hand (pure): operator keys, command signatures and their verification.

Each operator holds a secret token. The deployer's keys hold, per operator name, the
SHA-256 of the token, which is also the HMAC key: the CLI signs every command with
``HMAC-SHA256(sha256(token), payload)``, where the payload covers the command id (its
nonce), kind, operator name, version, reason and the time it was signed. The deployer
verifies each queued command before the state machine sees it, so:

- the command queue in Redis never carries a secret: whoever reads it cannot forge another
  command, nor change the version or reason of this one;
- a command copied back into the queue is refused: its id was seen (``replayed``), or it
  is older than ``max_age_s`` (``expired``), by which time its id is forgotten;
- the raw token never leaves the operator's machine; the keys file is still a secret (it
  can sign), so it lives in a Secret readable by the deployer only.

Keys are text, one operator per line as ``name:hex-sha256(token)`` (``#`` comments and
blank lines allowed; an operator may have several lines while a token is rotated), or a
JSON object ``{"name": "hex"}`` / ``{"name": ["hex", "hex"]}``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, replace

from deployer import holdout
from deployer.status import Command, Refusal
from ingest import auth as hmac_auth

SCHEME = "rtrl-operator-v1"
UNAUTHENTICATED = "unauthenticated"
"""The identity of an unsigned command accepted because ``allow_unauthenticated`` is set."""
RESULTS = ("accepted", UNAUTHENTICATED, "unknown_command", "unsigned", "no_keys", "unknown_operator",
           "bad_signature", "expired", "replayed")
"""Values of the ``result`` label of ``rtrl_operator_commands_total``."""
KINDS = ("pause", "resume", "promote", "rollback", "approve", *holdout.KINDS)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$")
_HEX = re.compile(r"^[0-9a-f]{64}$")

Keys = Mapping[str, tuple[bytes, ...]]
"""operator name -> signing keys (the SHA-256 digests of the operator's valid tokens)."""


def key_of(token: str) -> bytes:
    """The signing key the deployer holds for ``token``."""
    if not token:
        raise ValueError("an operator token must not be empty")
    return hashlib.sha256(token.encode()).digest()


def key_line(name: str, token: str) -> str:
    """The keys-file line for operator ``name`` with ``token``."""
    _check_name(name)
    return f"{name}:{key_of(token).hex()}"


def _check_name(name: str) -> None:
    if not _NAME.match(name):
        raise ValueError(f"operator name {name!r}: use 1-64 letters, digits, '.', '_', '@' or '-'")


def _add(keys: dict[str, tuple[bytes, ...]], name: str, value: str, where: str) -> None:
    name, value = name.strip(), value.strip().lower()
    try:
        _check_name(name)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    if not _HEX.match(value):
        raise ValueError(f"{where}: the key of {name!r} must be 64 hex digits, the SHA-256 of the token "
                         "(printf %s TOKEN | sha256sum)")
    keys[name] = (*keys.get(name, ()), bytes.fromhex(value))


def parse_keys(text: str) -> dict[str, tuple[bytes, ...]]:
    """Operator keys from ``name:hex`` lines or a JSON object; ValueError says what is wrong."""
    keys: dict[str, tuple[bytes, ...]] = {}
    if text.lstrip().startswith("{"):
        data = json.loads(text)
        for name, value in data.items():
            for v in value if isinstance(value, list) else [value]:
                _add(keys, str(name), str(v), "operator keys JSON")
        return keys
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise ValueError(f"operator keys line {n}: expected name:sha256-hex")
        _add(keys, name, value, f"operator keys line {n}")
    return keys


def payload(cmd: Command) -> bytes:
    """The signed bytes: every field the decision depends on, and when it was signed."""
    fields: list[object] = [SCHEME, cmd.id, cmd.kind, cmd.by, cmd.version, cmd.reason, repr(float(cmd.ts))]
    if cmd.share is not None or cmd.days is not None:  # holdout commands; others sign as before
        fields += [cmd.share, cmd.days]  # as queued: JSON keeps a float exactly
    return json.dumps(fields, separators=(",", ":"), ensure_ascii=False).encode()


def signature(cmd: Command, key: bytes) -> str:
    return hmac_auth.sign(payload(cmd), key)


def sign(cmd: Command, token: str, now: float) -> Command:
    """``cmd`` stamped with ``now`` and signed with the operator's token."""
    stamped = replace(cmd, ts=now, signature="")
    return replace(stamped, signature=signature(stamped, key_of(token)))


@dataclass(frozen=True)
class Verdict:
    """What the deployer concluded about one queued command."""

    result: str
    """One of ``RESULTS``: accepted, unauthenticated, or why it was refused."""
    operator: str = ""
    """The verified operator's name (``unauthenticated`` for an allowed unsigned command)."""
    message: str = ""
    """Why it was refused, for the CLI and the ledger ('' when accepted)."""

    @property
    def ok(self) -> bool:
        return self.result in ("accepted", UNAUTHENTICATED)


@dataclass(frozen=True)
class Authority:
    """How the deployer verifies commands (built from OperatorSettings each tick)."""

    keys: Keys
    max_age_s: float = 300.0
    allow_unauthenticated: bool = False
    error: str = ""
    """Why the keys could not be read ('' when they were): every command is then refused."""


def verify(cmd: Command, auth: Authority, now: float, seen: bool) -> Verdict:
    """Accept ``cmd`` only when an operator with a known key signed it, within ``max_age_s``
    of ``now``, and its id was not ``seen`` on an accepted command before."""
    if cmd.kind not in KINDS:
        return Verdict("unknown_command", message=f"unknown command {str(cmd.kind)[:40]!r}")
    if auth.error:
        return Verdict("no_keys", message=f"operator keys unavailable: {auth.error}")
    if not cmd.signature:
        if auth.allow_unauthenticated:
            return Verdict(UNAUTHENTICATED, UNAUTHENTICATED)
        if not auth.keys:
            return Verdict("no_keys", message="no operator keys configured (RTRL_OPERATORS__KEYS_FILE); "
                                              "manual commands are refused (docs/operations.md)")
        return Verdict("unsigned", message="unsigned command: set RTRL_OPERATORS__TOKEN or --token-file")
    keys = auth.keys.get(cmd.by)
    if not keys:
        return Verdict("unknown_operator", message=f"unknown operator {cmd.by!r}")
    if not any(hmac.compare_digest(signature(cmd, k), cmd.signature) for k in keys):
        return Verdict("bad_signature", message=f"bad signature for operator {cmd.by!r}")
    age = now - cmd.ts
    if abs(age) > auth.max_age_s:
        return Verdict("expired", message=f"signed {age:.0f}s ago; commands are valid for "
                                          f"{auth.max_age_s:g}s (check the clocks)")
    if seen:
        return Verdict("replayed", message=f"command {cmd.id} was already executed")
    return Verdict("accepted", cmd.by)


def as_verified(cmd: Command, verdict: Verdict) -> Command:
    """The command the state machine sees: ``by`` is the verified identity; an unsigned one
    accepted as unauthenticated keeps the name it claimed in its reason."""
    if verdict.result == UNAUTHENTICATED:
        claimed = f"[unauthenticated; claimed by {cmd.by}]"
        return replace(cmd, by=UNAUTHENTICATED, reason=f"{cmd.reason} {claimed}".strip())
    return replace(cmd, by=verdict.operator)


def kind_label(kind: str) -> str:
    """A bounded ``command`` label: queued JSON may name anything."""
    return kind if kind in KINDS else "other"


@dataclass(frozen=True)
class Screened:
    """The queue after verification: what the state machine executes, what it only records."""

    accepted: tuple[Command, ...] = ()
    refused: tuple[Refusal, ...] = ()
    counts: tuple[tuple[str, str], ...] = ()
    """(command label, result) of every newly verified command, for the metric."""


def screen(pending: Iterable[Command], handled: Collection[str], auth: Authority, now: float,
           seen: Collection[str]) -> Screened:
    """Verify the queued commands not handled yet. ``handled``: ids in the persisted status
    (passed through: the state machine skips them); ``seen``: ids of commands accepted before
    (a replay). Refusals keep the name the command claimed, for the ledger."""
    accepted: list[Command] = []
    refused: list[Refusal] = []
    counts: list[tuple[str, str]] = []
    for cmd in pending:
        if cmd.id in handled:
            accepted.append(cmd)
            continue
        verdict = verify(cmd, auth, now, cmd.id in seen)
        counts.append((kind_label(str(cmd.kind)), verdict.result))
        if verdict.ok:
            accepted.append(as_verified(cmd, verdict))
        else:
            refused.append(Refusal(cmd, verdict.message))
    return Screened(tuple(accepted), tuple(refused), tuple(counts))
