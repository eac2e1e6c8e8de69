from __future__ import annotations

import hashlib
import hmac

import pytest

from ingest.auth import AuthPolicy, authenticate, header_value, sign, verify

SECRET = b"s3cret"
POLICY = AuthPolicy(keys={"gw": SECRET})


Hdrs = list[tuple[str, bytes | None]]


def signed_headers(value: bytes, key_id: str = "gw", secret: bytes = SECRET) -> Hdrs:
    return [("rtrl-key-id", key_id.encode()), ("rtrl-signature", sign(value, secret).encode())]


def test_sign_matches_plain_hmac_reference() -> None:
    # RFC 4231 test case 2
    assert sign(b"what do ya want for nothing?", b"Jefe") == (
        "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
    )
    assert sign(b"x", b"k") == hmac.new(b"k", b"x", hashlib.sha256).hexdigest()


@pytest.mark.parametrize(
    ("sig", "ok"),
    [
        (sign(b"payload", SECRET), True),
        (sign(b"payload", SECRET).upper(), True),
        (sign(b"payload", SECRET).encode(), True),
        (sign(b"payload!", SECRET), False),
        (sign(b"payload", b"other"), False),
        ("", False),
        ("zz", False),
        ("é" * 64, False),
        (b"\xff\xfe", False),
    ],
)
def test_verify(sig: str | bytes, ok: bool) -> None:
    assert verify(b"payload", SECRET, sig) is ok


def test_header_lookup_is_case_insensitive_and_takes_last() -> None:
    headers: list[tuple[str, bytes | None]] = [("A", b"1"), ("a", b"2"), ("b", None)]
    assert header_value(headers, "a") == b"2"
    assert header_value(headers, "b") == b""
    assert header_value(headers, "c") is None


def test_good_signature_passes() -> None:
    assert authenticate(b"{}", signed_headers(b"{}"), POLICY) is None


@pytest.mark.parametrize(
    ("headers", "allow_unsigned", "reason"),
    [
        ([], False, "unsigned"),
        ([("rtrl-key-id", b"gw")], False, "unsigned"),
        ([("rtrl-signature", b"00")], False, "unknown_key"),
        (signed_headers(b"{}", key_id="nobody"), False, "unknown_key"),
        (signed_headers(b"{}", key_id="nobody"), True, "unknown_key"),
        (signed_headers(b"{ }"), False, "bad_signature"),
        (signed_headers(b"{ }"), True, "bad_signature"),  # allow_unsigned never excuses a bad one
        (signed_headers(b"{}", secret=b"wrong"), False, "bad_signature"),
    ],
)
def test_rejections(headers: list[tuple[str, bytes | None]], allow_unsigned: bool, reason: str) -> None:
    policy = AuthPolicy(keys={"gw": SECRET}, allow_unsigned=allow_unsigned)
    failure = authenticate(b"{}", headers, policy)
    assert failure is not None and failure.reason == reason
    assert SECRET.decode() not in failure.detail


def test_unsigned_allowed_in_dev() -> None:
    assert authenticate(b"{}", [], AuthPolicy(keys={}, allow_unsigned=True)) is None
