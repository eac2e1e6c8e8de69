"""Producer authentication for the raw topic: HMAC-SHA256 over the record value.

A producer holds a key id and a shared secret (``AuthSettings.keys`` maps key id ->
secret on the ingest side). It sends two Kafka headers with every record:

* ``rtrl-key-id``    the key id, UTF-8;
* ``rtrl-signature`` ``hex(HMAC-SHA256(secret, value))``, lower-case ASCII.

The signature covers the exact value bytes, so any re-serialisation on the way breaks
it. ``authenticate`` is pure: it takes the headers and the known keys and returns
``None`` when the record may pass, or an :class:`AuthFailure` with one of the reason
codes ``unsigned``, ``bad_signature``, ``unknown_key``.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

Headers = Sequence[tuple[str, bytes | None]]
"""Kafka record headers as kafka-python gives them: (name, value) pairs."""


def sign(payload: bytes, secret: bytes) -> str:
    """The hex HMAC-SHA256 signature of ``payload`` under ``secret``."""
    return hmac.new(secret, payload, hashlib.sha256).hexdigest()


def verify(payload: bytes, secret: bytes, signature: str | bytes) -> bool:
    """True when ``signature`` (hex) is the signature of ``payload``; constant-time."""
    if isinstance(signature, bytes):
        try:
            signature = signature.decode("ascii")
        except UnicodeDecodeError:
            return False
    expected = sign(payload, secret)
    # compare_digest on str requires ASCII; a non-ASCII signature is simply wrong.
    if not signature.isascii():
        return False
    return hmac.compare_digest(expected, signature.strip().lower())


def header_value(headers: Headers, name: str) -> bytes | None:
    """The last value of header ``name`` (names compare case-insensitively), or None."""
    found: bytes | None = None
    lname = name.lower()
    for key, value in headers:
        if key.lower() == lname:
            found = value if value is not None else b""
    return found


@dataclass(frozen=True)
class AuthFailure:
    reason: str
    """``unsigned`` | ``bad_signature`` | ``unknown_key``"""
    detail: str


@dataclass(frozen=True)
class AuthPolicy:
    """What ``authenticate`` checks against: secrets by key id and the header names."""

    keys: Mapping[str, bytes]
    allow_unsigned: bool = False
    key_id_header: str = "rtrl-key-id"
    signature_header: str = "rtrl-signature"


def authenticate(value: bytes, headers: Headers, policy: AuthPolicy) -> AuthFailure | None:
    """Check a record's signature headers; None means it may pass.

    * no signature header: ``unsigned`` (passes only when ``allow_unsigned``);
    * a signature whose key id is missing or not configured: ``unknown_key``;
    * a signature that does not match: ``bad_signature``.

    A record that carries a signature is always checked, even when unsigned input is
    allowed: a wrong signature means a misconfigured or hostile producer.
    """
    signature = header_value(headers, policy.signature_header)
    if signature is None:
        if policy.allow_unsigned:
            return None
        return AuthFailure("unsigned", f"no {policy.signature_header} header")
    raw_key_id = header_value(headers, policy.key_id_header)
    if raw_key_id is None:
        return AuthFailure("unknown_key", f"signed, but no {policy.key_id_header} header")
    key_id = raw_key_id.decode("utf-8", errors="replace")
    secret = policy.keys.get(key_id)
    if secret is None:
        return AuthFailure("unknown_key", f"the {policy.key_id_header} header names no configured key "
                                          f"({len(raw_key_id)} bytes; not echoed)")
    if not verify(value, secret, signature):  # a configured id: safe to name
        return AuthFailure("bad_signature", f"signature does not match configured key id {key_id!r}")
    return None
