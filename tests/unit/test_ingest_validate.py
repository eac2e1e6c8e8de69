"""The validator against a corpus of bad inputs: one or more cases per reason code."""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime, timedelta

import pytest

from ingest.auth import AuthPolicy, sign
from ingest.events import CompletionServed, EditPersistence
from ingest.validate import DETAIL_MAX, REASONS, Accepted, Limits, Rejected, duplicate_key, validate

NOW = datetime(2026, 11, 22, 10, 0, tzinfo=UTC)
SECRET = b"k"
AUTH = AuthPolicy(keys={"gw": SECRET})
LIMITS = Limits(max_bytes=64 * 1024, max_future_skew_s=300, max_age_s=7 * 86_400)


def served(**over: object) -> dict[str, object]:
    base: dict[str, object] = {
        "schema_version": 1, "event_id": "e1", "type": "completion.served", "request_id": "r1",
        "ts": "2026-11-22T09:59:00Z", "session_id": "s1", "user_key": "u1",
        "model": {"name": "rtrl-policy", "version": "3"}, "arm": "canary",
        "prompt_tokens": [1, 2], "completion_tokens": [3, 4, 5], "logprobs": [-0.1, -2.0, 0.0],
        "latency_ms": 120.5,
    }
    base.update(over)
    return base


def without(field: str) -> dict[str, object]:
    return {k: v for k, v in served().items() if k != field}


def enc(obj: object) -> bytes:
    return json.dumps(obj).encode()


def headers(value: bytes) -> list[tuple[str, bytes | None]]:
    return [("rtrl-key-id", b"gw"), ("rtrl-signature", sign(value, SECRET).encode())]


def check(value: bytes | None, key: bytes | None = b"r1", auth: AuthPolicy = AUTH,
          hdrs: list[tuple[str, bytes | None]] | None = None) -> Accepted | Rejected:
    h = headers(value or b"") if hdrs is None else hdrs
    return validate(value, h, key, NOW, LIMITS, auth)


def ts(delta: timedelta) -> str:
    return (NOW + delta).isoformat()


# (case name, value bytes, expected reason)
CORPUS: list[tuple[str, bytes, str]] = [
    ("oversized", enc(served(reason="x" * 70_000)), "oversized"),
    ("oversized_garbage", b"\xff" * (64 * 1024 + 1), "oversized"),
    ("latin1", '{"event_id": "é"}'.encode("latin-1"), "not_utf8"),
    ("random_bytes", bytes(range(256)), "not_utf8"),
    ("truncated", enc(served())[:-5], "bad_json"),
    ("empty", b"", "bad_json"),
    ("trailing_garbage", enc(served()) + b" }", "bad_json"),
    ("utf8_bom", b"\xef\xbb\xbf" + enc(served()), "bad_json"),
    ("deep_array", b"[" * 20_000 + b"]" * 20_000, "bad_json"),
    ("deep_object", b'{"a":' * 5_000 + b"1" + b"}" * 5_000, "bad_json"),
    ("single_quotes", b"{'event_id': 'e1'}", "bad_json"),
    ("array", b"[1, 2]", "not_object"),
    ("string", b'"completion.served"', "not_object"),
    ("null", b"null", "not_object"),
    ("number", b"42", "not_object"),
    ("schema_v2", enc(served(schema_version=2)), "unknown_schema_version"),
    ("schema_v2_unknown_type", enc(served(schema_version=2, type="brand.new")), "unknown_schema_version"),
    ("schema_as_string", enc(served(schema_version="1")), "unknown_schema_version"),
    ("schema_as_true", enc(served(schema_version=True)), "unknown_schema_version"),
    ("unknown_type", enc(served(type="completion.deleted")), "unknown_type"),
    ("type_is_number", enc(served(type=7)), "unknown_type"),
    ("no_type", enc(without("type")), "missing_field"),
    ("no_request_id", enc(without("request_id")), "missing_field"),
    ("no_event_id", enc(without("event_id")), "missing_field"),
    ("no_ts", enc(without("ts")), "missing_field"),
    ("empty_object", b"{}", "missing_field"),
    ("negative_latency", enc(served(latency_ms=-1)), "invalid_field"),
    ("latency_string", enc(served(latency_ms="fast")), "invalid_field"),
    ("nan_latency", enc(served(latency_ms=float("nan"))), "invalid_field"),
    ("nan_logprob", enc(served()).replace(b"-2.0", b"NaN"), "invalid_field"),
    ("infinite_latency", enc(served()).replace(b"120.5", b"Infinity"), "invalid_field"),
    ("positive_logprob", enc(served(logprobs=[-0.1, 0.5, 0.0])), "invalid_field"),
    ("logprob_count", enc(served(logprobs=[-0.1])), "invalid_field"),
    ("huge_token_array", enc(served(prompt_tokens=list(range(40_000)))), "oversized"),
    ("token_negative", enc(served(prompt_tokens=[-1])), "invalid_field"),
    ("token_float", enc(served(prompt_tokens=[1.5])), "invalid_field"),
    # strict types, as the JSON Schema says: no coercion of strings or booleans
    ("token_string", enc(served(prompt_tokens=["1"])), "invalid_field"),
    ("latency_numeric_string", enc(served(latency_ms="120.5")), "invalid_field"),
    ("tool_calls_bool", enc(served(tool_calls=True)), "invalid_field"),
    ("ts_epoch_seconds", enc(served(ts=1795000000)), "invalid_field"),
    ("request_id_int", enc(served(request_id=5)), "invalid_field"),
    ("request_id_empty", enc(served(request_id="")), "invalid_field"),
    ("request_id_spaces", enc(served(request_id="a b")), "invalid_field"),
    ("model_not_object", enc(served(model="rtrl-policy")), "invalid_field"),
    ("arm_unknown", enc(served(arm="blue")), "invalid_field"),
    ("extra_field", enc(served(source_code="print(1)")), "invalid_field"),
    ("naive_ts", enc(served(ts="2026-11-22T09:59:00")), "invalid_field"),
    ("ts_garbage", enc(served(ts="yesterday")), "invalid_field"),
    ("invalid_tools", enc(served(tool_calls=1, invalid_tool_calls=2)), "invalid_field"),
    ("retained_gt_inserted", enc({"event_id": "e2", "request_id": "r1", "type": "edit.persistence",
                                  "ts": ts(timedelta(0)), "horizon_s": 60, "retained_chars": 9,
                                  "inserted_chars": 3}), "invalid_field"),
    ("tool_calls_beyond_int64", enc(served(tool_calls=10**40, invalid_tool_calls=0)), "invalid_field"),
    ("tool_calls_2_63", enc(served(tool_calls=2**63)), "invalid_field"),
    ("inserted_chars_beyond_int64", enc({"event_id": "e3", "request_id": "r1", "type": "edit.accepted",
                                         "ts": ts(timedelta(0)), "inserted_chars": 10**40}), "invalid_field"),
    ("ts_before_year_1_in_utc", enc(served(ts="0001-01-01T00:00:00+14:00")), "invalid_field"),
    ("ts_after_year_9999_in_utc", enc(served(ts="9999-12-31T23:59:59-14:00")), "invalid_field"),
    ("duplicate_request_id", enc(served())[:-1] + b', "request_id": "r2"}', "duplicate_key"),
    ("duplicate_same_value", enc(served())[:-1] + b', "request_id": "r1"}', "duplicate_key"),
    ("duplicate_nested", enc(served()).replace(b'"version": "3"', b'"version": "3", "version": "4"'),
     "duplicate_key"),
    ("ts_future", enc(served(ts=ts(timedelta(seconds=301)))), "ts_future"),
    ("ts_far_future", enc(served(ts="2999-01-01T00:00:00Z")), "ts_future"),
    ("ts_ancient", enc(served(ts="1970-01-01T00:00:00Z")), "ts_too_old"),
    ("ts_8_days", enc(served(ts=ts(-timedelta(days=8)))), "ts_too_old"),
]


@pytest.mark.parametrize(("value", "reason"), [c[1:] for c in CORPUS], ids=[c[0] for c in CORPUS])
def test_corpus(value: bytes, reason: str) -> None:
    out = check(value)
    assert isinstance(out, Rejected), out
    assert out.reason == reason, out.detail
    assert out.reason in REASONS
    assert len(out.detail) <= DETAIL_MAX


def test_huge_array_within_size_limit_is_invalid_not_oversized() -> None:
    big = Limits(max_bytes=10**6)
    value = enc(served(prompt_tokens=[1] * 40_000))
    out = validate(value, headers(value), b"r1", NOW, big, AUTH)
    assert isinstance(out, Rejected) and out.reason == "invalid_field"
    assert "prompt_tokens" in out.detail


def test_every_reason_is_exercised() -> None:
    covered = {c[2] for c in CORPUS} | {"unsigned", "bad_signature", "unknown_key", "key_mismatch"}
    assert covered | {"duplicate"} == set(REASONS)


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"latency_ms": -1}, "latency_ms"),
        ({"arm": "blue"}, "arm"),
        ({"model": {"name": "x"}}, "model.version"),
    ],
)
def test_detail_names_the_field(over: dict[str, object], field: str) -> None:
    out = check(enc(served(**over)))
    assert isinstance(out, Rejected)
    assert out.detail.startswith(f"{field}:"), out.detail
    assert "completion.served" not in out.detail  # the union tag is stripped from locations


def test_missing_request_id_detail() -> None:
    out = check(enc(without("request_id")))
    assert out == Rejected("missing_field", "request_id: Field required")


def test_valid_events_accepted_and_normalised() -> None:
    out = check(enc(served(ts="2026-11-22T11:59:00+02:00")))
    assert isinstance(out, Accepted) and isinstance(out.event, CompletionServed)
    assert out.event.ts == datetime(2026, 11, 22, 9, 59, tzinfo=UTC)
    value = enc({"event_id": "p", "request_id": "r1", "type": "edit.persistence", "ts": ts(timedelta(0)),
                 "horizon_s": 60, "retained_chars": 2, "inserted_chars": 3})
    out = check(value)
    assert isinstance(out, Accepted) and isinstance(out.event, EditPersistence)


def test_timestamp_window_edges() -> None:
    assert isinstance(check(enc(served(ts=ts(timedelta(seconds=300))))), Accepted)
    assert isinstance(check(enc(served(ts=ts(-timedelta(days=7))))), Accepted)


def test_auth_reasons_come_before_parsing() -> None:
    assert check(b"not json", hdrs=[]) == Rejected("unsigned", "no rtrl-signature header")
    bad = [("rtrl-key-id", b"gw"), ("rtrl-signature", sign(b"other", SECRET).encode())]
    out = check(enc(served()), hdrs=bad)
    assert isinstance(out, Rejected) and out.reason == "bad_signature"
    unknown = [("rtrl-key-id", b"intruder"), ("rtrl-signature", b"00")]
    out = check(enc(served()), hdrs=unknown)
    assert isinstance(out, Rejected) and out.reason == "unknown_key"


def test_allow_unsigned_still_validates() -> None:
    dev = AuthPolicy(keys={}, allow_unsigned=True)
    assert isinstance(check(enc(served()), hdrs=[], auth=dev), Accepted)
    out = check(b"{", hdrs=[], auth=dev)
    assert isinstance(out, Rejected) and out.reason == "bad_json"


def test_key_must_match_request_id_when_present() -> None:
    assert isinstance(check(enc(served()), key=None), Accepted)
    out = check(enc(served()), key=b"r2")
    assert isinstance(out, Rejected) and out.reason == "key_mismatch"


def test_tombstone_value_is_rejected_not_raised() -> None:
    out = check(None)
    assert isinstance(out, Rejected) and out.reason == "bad_json"


def test_never_raises_on_random_input() -> None:
    import random

    rng = random.Random(7)
    base = enc(served())
    dev = AuthPolicy(keys={}, allow_unsigned=True)
    for _ in range(2000):
        b = bytearray(base)
        for _ in range(rng.randint(1, 6)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        out = validate(bytes(b), [], None, NOW, LIMITS, dev)
        assert isinstance(out, (Accepted, Rejected))
        if isinstance(out, Rejected):
            assert out.reason in REASONS


def test_int64_max_is_still_a_valid_count() -> None:
    assert isinstance(check(enc(served(tool_calls=2**63 - 1))), Accepted)


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity"])
def test_non_finite_latency_says_finite_not_a_bound(literal: bytes) -> None:
    value = enc(served()).replace(b'"latency_ms": 120.5', b'"latency_ms": ' + literal)
    out = check(value)
    assert isinstance(out, Rejected) and out.reason == "invalid_field"
    assert out.detail == "latency_ms: Input should be a finite number"


def test_out_of_range_ts_names_the_range() -> None:
    out = check(enc(served(ts="0001-01-01T00:00:00+14:00")))
    assert isinstance(out, Rejected)
    assert out.detail.startswith("ts: ") and "range" in out.detail


@pytest.mark.parametrize(("version", "says"), [
    ("1", "must be the integer 1, not a string"), (True, "not a boolean"), (1.5, "not a fraction"),
    ([1], "not an array"), (None, "not null"), (2, "an integer other than 1"),
])
def test_schema_version_detail_says_what_is_wrong(version: object, says: str) -> None:
    out = check(enc(served(schema_version=version)))
    assert isinstance(out, Rejected) and out.reason == "unknown_schema_version"
    assert says in out.detail, out.detail


def test_duplicate_key_finder() -> None:
    assert duplicate_key(b'{"a": 1, "b": {"c": 2, "c": 3}}') == "c"
    assert duplicate_key(b'{"a": 1, "b": [{"a": 2}, {"a": 3}]}') is None  # the same key in two objects
    assert duplicate_key(b"[" * 50_000) is None  # not JSON: another check reports it
    assert duplicate_key(b'{"a": 1}') is None
    assert duplicate_key(b'{"a": "x\\"y", "a": 2}') == "a"  # escapes: read object by object
    assert duplicate_key('{"k": ":", "v": "\\":", "k": 1}') == "k"
    assert duplicate_key(b'{"a" :1, "b":{"a":2}}') is None  # a name in two objects is no repeat


def _slow_duplicate(data: str) -> str | None:
    """The plain reference: every object parsed, its keys compared."""
    found: list[str] = []

    def hook(pairs: list[tuple[str, object]]) -> dict[str, object]:
        names = [k for k, _ in pairs]
        if not found:
            found.extend(k for i, k in enumerate(names) if k in names[:i])
        return dict(pairs)

    json.loads(data, object_pairs_hook=hook)
    return found[0] if found else None


def _random_doc(rng: random.Random, depth: int = 0) -> str:
    """A JSON object written by hand (so keys may repeat), with escapes, colons and quotes in
    strings, and whitespace around the colons."""
    names = ["a", "b", "k:", 'q"', "\\", "", "a b", "\u00e9"]
    parts = []
    for _ in range(rng.randint(0, 5)):
        key = json.dumps(rng.choice(names))
        roll = rng.random()
        if roll < 0.3 and depth < 3:
            value = _random_doc(rng, depth + 1)
        elif roll < 0.5 and depth < 3:
            value = "[" + ", ".join(_random_doc(rng, depth + 1) for _ in range(rng.randint(0, 2))) + "]"
        else:
            value = json.dumps(rng.choice(["x", 'say "hi":', "a\\b", 3, None, True, ":", "\"k\": 1"]))
        parts.append(f"{key}{rng.choice(['', ' ', chr(10)])}:{rng.choice(['', ' '])}{value}")
    return "{" + ", ".join(parts) + "}"


def test_duplicate_key_finder_agrees_with_parsing_every_object() -> None:
    rng = random.Random(20261128)
    docs = [_random_doc(rng) for _ in range(3000)]
    for doc in docs:
        expected = _slow_duplicate(doc)
        assert duplicate_key(doc) == expected, doc
        assert duplicate_key(doc.encode()) == expected, doc
    assert sum(_slow_duplicate(d) is not None for d in docs) > 300  # both kinds were tried


SECRET_TEXT = "s3cr3t-payload-TEXT"


@pytest.mark.parametrize(("value", "key", "hdrs"), [
    (enc(served(**{SECRET_TEXT: 1})), b"r1", None),                      # unknown field name
    (enc(served(type=SECRET_TEXT)), b"r1", None),                        # unknown type tag
    (enc(served(schema_version=SECRET_TEXT)), b"r1", None),              # schema_version text
    (enc(served(arm=SECRET_TEXT)), b"r1", None),                         # bad enum value
    (enc(served(request_id=SECRET_TEXT)), SECRET_TEXT.encode() + b"x", None),   # key mismatch
    (enc(served()), b"r1", [("rtrl-key-id", SECRET_TEXT.encode()), ("rtrl-signature", b"00")]),
    (enc(served())[:-1] + b', "' + SECRET_TEXT.encode() + b'": 1, "' + SECRET_TEXT.encode() + b'": 2}',
     b"r1", None),                                                       # duplicate unknown key
    (enc(served(model={"name": "m", "version": "1", SECRET_TEXT: 1})), b"r1", None),
])
def test_details_never_echo_payload_content(value: bytes, key: bytes,
                                            hdrs: list[tuple[str, bytes | None]] | None) -> None:
    out = check(value, key=key, hdrs=hdrs)
    assert isinstance(out, Rejected)
    assert SECRET_TEXT not in out.detail and SECRET_TEXT.lower() not in out.detail.lower(), out
    assert len(out.detail) <= DETAIL_MAX
