"""A seeded corpus of hostile raw records mixed with valid requests, for the ingest fuzz run.

``build(seed, n_bad, n_valid_requests, now, keys)`` returns a :class:`Corpus`: records in
send order (value bytes, Kafka key, headers), each labelled with what ingest must do with
it -- ``valid`` (forwarded once), ``duplicate`` (dropped by dedup, not dead-lettered by
default) or the reason code its DLQ record must carry -- and a fine-grained ``case``
name. Valid requests are full event sequences (served, accept/reject, persistence at
horizons, dissatisfied follow-ups, out-of-order and clock-skewed timestamps, feedback
before the served event); :meth:`Corpus.expected_reward` computes the reward each must
get from the plan alone, with the pure maths of ``ingest/reward/maths.py``.

The bad records cover every reason code of ``ingest.validate.REASONS``: oversized values,
unsigned, unknown keys, forged/tampered/garbled signatures, non-UTF-8 bytes, bad JSON (deep
nesting, numbers out of range, BOMs, tombstones...), non-objects, unknown schema versions
and types, missing fields, wrong types, NaN/Infinity, null bytes, giant keys and fields,
timestamps far in the future or the past, Kafka keys that are not the request id, junk
and duplicated headers, and replays of valid events (byte-identical or altered).

Each valid request's events are sent in an order where the event that lets the reward
window close early comes last (the final-horizon persistence, the rejection, the served
event of a question), so the expected reward does not depend on processing speed.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from ingest.auth import sign
from ingest.events import (
    CompletionServed,
    EditAccepted,
    EditPersistence,
    EditRejected,
    Event,
    FollowupDissatisfied,
    ModelRef,
)
from ingest.reward.maths import Feedback, compute_reward
from ingest.reward.spec import RewardSpec

Headers = list[tuple[str, bytes]]

KEY_ID_HEADER = "rtrl-key-id"
SIGNATURE_HEADER = "rtrl-signature"
MAX_BYTES = 256 * 1024
"""Ingest's default ``RTRL_INGEST__MAX_BYTES``; the run must not override it."""


@dataclass(frozen=True)
class Record:
    value: bytes | None
    key: bytes | None
    headers: Headers
    expect: str
    """``valid``, ``duplicate`` or the DLQ reason code."""
    case: str
    """Fine-grained label (``bad_signature/wrong_secret``)."""
    event_id: str | None = None
    """For valid records and duplicates: the event id."""


@dataclass
class Plan:
    """One valid request: its served event and its feedback events in send order."""

    served: CompletionServed
    events: list[Event]
    decisions: list[tuple[float, bool]] = field(default_factory=list)
    """(ts, accepted) of every accept/reject, in send order."""
    persistence: list[tuple[int, float, int, int]] = field(default_factory=list)
    """(horizon, ts, retained, inserted) in send order."""
    dissatisfied: int = 0
    scenario: str = ""

    def feedback(self) -> Feedback:
        """What the join must conclude, derived from the plan (docs/rewards.md): the latest
        accept/reject by producer ts wins and a tie goes to reject; per horizon the latest
        report by ts wins (a later-sent report wins a tie)."""
        decision: tuple[float, bool] | None = None
        for ts, acc in self.decisions:
            if decision is None or ts > decision[0] or (ts == decision[0] and not acc):
                decision = (ts, acc)
        pers: dict[int, tuple[float, int, int]] = {}
        for h, ts, r, i in self.persistence:
            if h not in pers or ts >= pers[h][0]:
                pers[h] = (ts, r, i)
        return Feedback(
            accepted=None if decision is None else decision[1],
            persistence={h: (r, i) for h, (_, r, i) in pers.items()},
            dissatisfied=self.dissatisfied,
        )


@dataclass
class Corpus:
    records: list[Record]
    plans: dict[str, Plan]

    def expected_reward(self, request_id: str, spec: RewardSpec) -> tuple[float, dict[str, float]]:
        plan = self.plans[request_id]
        return compute_reward(plan.feedback(), plan.served, spec)

    def count(self, attr: str = "expect") -> Counter[str]:
        return Counter(getattr(r, attr) for r in self.records)

    def by_category(self) -> dict[str, int]:
        """Bad records per category (the part of ``case`` before the slash)."""
        return dict(sorted(Counter(r.case.split("/")[0] for r in self.records
                                   if r.expect != "valid").items()))


# ---------------------------------------------------------------------- valid requests


class _Valid:
    def __init__(self, rng: random.Random, now: datetime, keys: Mapping[str, bytes], seed: int) -> None:
        self.rng = rng
        self.now = now
        self.keys = keys
        self.seed = seed
        self.n = 0

    def eid(self, rid: str, tag: str) -> str:
        self.n += 1
        return f"{rid}-{tag}{self.n}"

    def signed_headers(self, value: bytes) -> Headers:
        """Signed by one of the configured keys (producers under different key ids)."""
        key_id = self.rng.choice(sorted(self.keys))
        return [(KEY_ID_HEADER, key_id.encode()), (SIGNATURE_HEADER, sign(value, self.keys[key_id]).encode())]

    def signed(self, ev: Event) -> Record:
        value = ev.model_dump_json().encode()
        return Record(value, ev.request_id.encode(), self.signed_headers(value), "valid",
                      f"valid/{ev.type}", ev.event_id)

    def plan(self, i: int) -> Plan:
        rid = f"fz{self.seed}-r{i}"
        t0 = self.now - timedelta(seconds=3700 - i * 0.01)  # the 3610 s report stays in the past
        kind = self.rng.choices(["edit", "question", "empty"], [0.7, 0.15, 0.15])[0]
        plan = Plan(self.served(i, rid, t0, kind), [])
        feedback = _Feedback(self, plan, t0)
        if kind != "edit":
            return _plan_no_edit(plan, feedback, kind)
        return _plan_edit(plan, feedback)

    def served(self, i: int, rid: str, t0: datetime, kind: str) -> CompletionServed:
        rng = self.rng
        tools = rng.randint(0, 3)
        n_out = rng.randint(0, 6) if kind == "edit" else rng.randint(1, 3)
        served_ts = self.now + timedelta(seconds=200) if rng.random() < 0.05 else t0  # tolerated skew
        return CompletionServed(
            event_id=self.eid(rid, "s"), request_id=rid, ts=served_ts, session_id=f"sess-{i % 17}",
            user_key=f"user-{i % 53}", model=ModelRef(name="rtrl-policy", version=str(1 + i % 3)),
            arm=rng.choice(["stable", "canary"]),
            prompt_tokens=[rng.randrange(0, 500) for _ in range(rng.randint(1, 8))],
            completion_tokens=[rng.randrange(0, 500) for _ in range(n_out)],
            logprobs=[-rng.random() * 5 for _ in range(n_out)],
            latency_ms=round(rng.uniform(0, 6000), 3), tool_calls=tools,
            invalid_tool_calls=rng.randint(0, tools), completion_kind=kind,
        )


class _Feedback:
    """The feedback events of one planned request, ``s`` seconds after its start; each is
    recorded in the plan, so the plan knows what the join must conclude."""

    def __init__(self, valid: _Valid, plan: Plan, t0: datetime) -> None:
        self.valid = valid
        self.rng = valid.rng
        self.plan = plan
        self.rid = plan.served.request_id
        self.t0 = t0

    def at(self, s: float) -> datetime:
        return self.t0 + timedelta(seconds=s)

    def decide(self, accept: bool, s: float, chars: int = 100) -> Event:
        self.plan.decisions.append((self.at(s).timestamp(), accept))
        cls = EditAccepted if accept else EditRejected
        return cls(event_id=self.valid.eid(self.rid, "a" if accept else "r"), request_id=self.rid,
                   ts=self.at(s), inserted_chars=chars)

    def persist(self, h: int, s: float, kept: int, chars: int = 100) -> Event:
        self.plan.persistence.append((h, self.at(s).timestamp(), kept, chars))
        return EditPersistence(event_id=self.valid.eid(self.rid, "p"), request_id=self.rid, ts=self.at(s),
                               horizon_s=h, retained_chars=kept, inserted_chars=chars)

    def unhappy(self, s: float) -> Event:
        self.plan.dissatisfied += 1
        return FollowupDissatisfied(event_id=self.valid.eid(self.rid, "d"), request_id=self.rid,
                                    ts=self.at(s), reason=self.rng.choice([None, "wrong", "too slow",
                                                                           "ünïcödé ✓"]))


def _plan_no_edit(plan: Plan, f: _Feedback, kind: str) -> Plan:
    """A question or an empty completion: the served event closes the window (after the
    follow-up time), so it goes last."""
    scenario = f.rng.choice(["quiet", "dissatisfied", "ignored_edit_events"])
    feedback: list[Event] = []
    if scenario == "dissatisfied":
        feedback = [f.unhappy(5)]
    elif scenario == "ignored_edit_events":  # no edit proposed: these must not count
        feedback = [f.decide(True, 2), f.persist(30, 40, 50)]
    plan.events = [*feedback, plan.served]
    plan.scenario = f"{kind}/{scenario}"
    return plan


def _plan_edit(plan: Plan, f: _Feedback) -> Plan:
    """An edit: its feedback shuffled around the served event, and the events that let the
    window close early (``last``) sent after everything else."""
    rng = f.rng
    scenario = rng.choice(list(EDIT_SCENARIOS))
    chars = rng.randint(1, 400)
    kept = [rng.randint(0, chars) for _ in range(3)]
    fb, last = EDIT_SCENARIOS[scenario](f, chars, kept)
    rng.shuffle(fb)
    pos = rng.randint(0, len(fb))  # feedback may come before the served event
    plan.events = [*fb[:pos], plan.served, *fb[pos:], *last]
    plan.scenario = f"edit/{scenario}"
    return plan


# Each edit scenario: (feedback in any order, events sent last) for (chars inserted, chars kept
# at three horizons). Their random draws follow the events they make.
def _full(f: _Feedback, chars: int, kept: list[int]) -> tuple[list[Event], list[Event]]:
    fb = [f.decide(True, 2, chars), f.persist(30, 40, kept[0], chars), f.persist(600, 610, kept[1], chars)]
    if f.rng.random() < 0.3:
        fb.append(f.unhappy(20))
    return fb, [f.persist(3600, 3610, kept[2], chars)]


def _partial(f: _Feedback, chars: int, kept: list[int]) -> tuple[list[Event], list[Event]]:
    """No final horizon: closes at the due time."""
    fb = [f.decide(True, 2, chars), f.persist(30, 40, kept[0], chars)]
    if f.rng.random() < 0.5:
        fb.append(f.persist(600, 610, kept[1], chars))
    return fb, []


def _rejected(f: _Feedback, chars: int, kept: list[int]) -> tuple[list[Event], list[Event]]:
    fb = [f.unhappy(10)] if f.rng.random() < 0.5 else []
    return fb, [f.decide(False, 3)]


def _conflict_accept_wins(f: _Feedback, chars: int, kept: list[int]) -> tuple[list[Event], list[Event]]:
    """The later-ts accept is sent first, the older reject after it: the accept stands.
    (Sent the other way round, the reject would close the window follow-up time after it
    was seen, and an accept processed later would be late: by design.)"""
    fb = [f.persist(30, 40, kept[0], chars)]
    return fb, [f.decide(True, 9, chars), f.decide(False, 4)]


def _conflict_reject_wins(f: _Feedback, chars: int, kept: list[int]) -> tuple[list[Event], list[Event]]:
    """The later-ts reject is sent first; it closes."""
    fb = [f.persist(30, 40, kept[0], chars)]
    return fb, [f.decide(False, 9), f.decide(True, 4, chars)]


def _tie(f: _Feedback, chars: int, kept: list[int]) -> tuple[list[Event], list[Event]]:
    """Same ts: reject wins."""
    fb = [f.decide(True, 5, chars)]
    return fb, [f.decide(False, 5)]


def _quiet(f: _Feedback, chars: int, kept: list[int]) -> tuple[list[Event], list[Event]]:
    """No feedback at all: the spec's default."""
    return [], []


def _restated(f: _Feedback, chars: int, kept: list[int]) -> tuple[list[Event], list[Event]]:
    """A horizon reported twice, the newer report sent first."""
    return [f.decide(True, 2, chars), f.persist(600, 700, kept[1], chars),
            f.persist(600, 650, kept[0], chars)], []


def _zero_inserted(f: _Feedback, chars: int, kept: list[int]) -> tuple[list[Event], list[Event]]:
    """A ratio with no inserted chars is unusable."""
    return [f.decide(True, 2, 0), f.persist(600, 610, 0, 0)], []


EDIT_SCENARIOS: dict[str, Callable[[_Feedback, int, list[int]], tuple[list[Event], list[Event]]]] = {
    "full": _full, "partial": _partial, "rejected": _rejected,
    "conflict_accept_wins": _conflict_accept_wins, "conflict_reject_wins": _conflict_reject_wins,
    "tie": _tie, "quiet": _quiet, "restated": _restated, "zero_inserted": _zero_inserted,
}
"""In the order the seeded draw picks from (by position): never reorder."""


# ---------------------------------------------------------------------- bad records


class _Bad:
    """Generators of hostile records; each returns (value, key, headers, reason, case)."""

    def __init__(self, rng: random.Random, now: datetime, keys: Mapping[str, bytes],
                 targets: list[str], seed: int) -> None:
        self.rng = rng
        self.now = now
        self.keys = keys
        self.key_id = sorted(keys)[0]
        self.targets = targets
        """Request ids of valid requests: forged feedback aims at them."""
        self.seed = seed
        self.n = 0

    # helpers -------------------------------------------------------------------
    def rid(self) -> str:
        if self.targets and self.rng.random() < 0.5:
            return self.rng.choice(self.targets)
        self.n += 1
        return f"fz{self.seed}-bad{self.n}"

    def event(self, **over: Any) -> dict[str, Any]:
        """A valid event of a random type (as a dict), then ``over`` applied."""
        rng = self.rng
        self.n += 1
        rid = self.rid()
        base: dict[str, Any] = {"schema_version": 1, "event_id": f"fz{self.seed}-x{self.n}",
                                "request_id": rid,
                                "ts": (self.now - timedelta(seconds=rng.randint(0, 3000))).isoformat()}
        typ = rng.choice(["completion.served", "edit.accepted", "edit.rejected", "edit.persistence",
                          "followup.dissatisfied"])
        base["type"] = typ
        if typ == "completion.served":
            base.update(session_id="s", user_key="u", model={"name": "rtrl-policy", "version": "1"},
                        arm="stable", prompt_tokens=[1, 2], completion_tokens=[3], logprobs=[-0.5],
                        latency_ms=10.0, tool_calls=1, invalid_tool_calls=0)
        elif typ in ("edit.accepted", "edit.rejected"):
            base["inserted_chars"] = 10
        elif typ == "edit.persistence":
            base.update(horizon_s=600, retained_chars=5, inserted_chars=10)
        else:
            base["reason"] = "meh"
        for k, v in over.items():
            if v is _DROP:
                base.pop(k, None)
            else:
                base[k] = v
        return base

    def served(self, **over: Any) -> dict[str, Any]:
        ev = self.event()
        while ev["type"] != "completion.served":
            ev = self.event()
        ev.update(over)
        return ev

    def sig(self, value: bytes, key_id: str | None = None) -> Headers:
        kid = key_id or self.rng.choice(sorted(self.keys))
        return [(KEY_ID_HEADER, kid.encode()), (SIGNATURE_HEADER, sign(value, self.keys[kid]).encode())]

    def signed(self, value: bytes, reason: str, case: str, key: bytes | str | None = "auto"
               ) -> tuple[bytes | None, bytes | None, Headers, str, str]:
        k = self._key_for(value) if key == "auto" else key
        return value, k if not isinstance(k, str) else k.encode(), self.sig(value), reason, case

    def _key_for(self, value: bytes) -> bytes | None:
        try:
            obj = json.loads(value)
            rid = obj.get("request_id") if isinstance(obj, dict) else None
        except (ValueError, RecursionError):
            rid = None
        if isinstance(rid, str) and self.rng.random() < 0.8:
            return rid.encode("utf-8", "surrogatepass")
        return None  # a record without a key is accepted and re-keyed

    # categories ------------------------------------------------------------------
    def oversized(self) -> Any:
        rng = self.rng
        variant = rng.choice(["padded_field", "garbage", "truncated_in_dlq", "exact_limit_plus_one"])
        if variant == "padded_field":
            value = enc(self.event(type="followup.dissatisfied", reason="x" * (MAX_BYTES + 100)))
        elif variant == "garbage":
            value = rng.randbytes(MAX_BYTES + rng.randint(1, 5000))
        elif variant == "truncated_in_dlq":  # larger than the DLQ keeps (512 KiB)
            value = b"{" + b" " * (600 * 1024) + b"}"
        else:
            value = b"[" + b"0," * ((MAX_BYTES - 1) // 2) + b"0]"
            value = value + b" " * (MAX_BYTES + 1 - len(value))
        hdrs = self.sig(value) if rng.random() < 0.5 else []  # size is checked before auth
        return value, None, hdrs, "oversized", f"oversized/{variant}"

    def unsigned(self) -> Any:
        value = enc(self.event())
        variant = self.rng.choice(["no_headers", "key_id_only", "junk_headers", "signature_name_typo"])
        hdrs: Headers = []
        if variant == "key_id_only":
            hdrs = [(KEY_ID_HEADER, self.key_id.encode())]
        elif variant == "junk_headers":
            hdrs = [(f"x-junk-{j}", self.rng.randbytes(8)) for j in range(100)]
            hdrs.append(("x" * 10_000, b"long header name"))
        elif variant == "signature_name_typo":
            hdrs = [(KEY_ID_HEADER, self.key_id.encode()),
                    ("rtrl-signatur", sign(value, self.keys[self.key_id]).encode())]
        return value, self._key_for(value), hdrs, "unsigned", f"unsigned/{variant}"

    def unknown_key(self) -> Any:
        value = enc(self.event())
        good = sign(value, self.keys[self.key_id]).encode()
        variant = self.rng.choice(["unknown_id", "no_key_id", "non_utf8_key_id", "empty_key_id",
                                   "retired_key", "key_id_is_a_secret_name"])
        kid: bytes = {
            "unknown_id": b"attacker", "non_utf8_key_id": b"\xff\xfegw", "empty_key_id": b"",
            "retired_key": b"gateway-2019", "key_id_is_a_secret_name": b"../../etc/shadow",
        }.get(variant, b"")
        hdrs: Headers = [(SIGNATURE_HEADER, good)]
        if variant != "no_key_id":
            hdrs.insert(0, (KEY_ID_HEADER, kid))
        if variant == "retired_key":
            hdrs = [(KEY_ID_HEADER, kid), (SIGNATURE_HEADER, sign(value, b"old-secret").encode())]
        return value, self._key_for(value), hdrs, "unknown_key", f"unknown_key/{variant}"

    def bad_signature(self) -> Any:
        ev = self.event()
        value = enc(ev)
        kid = self.key_id
        variant = self.rng.choice(["wrong_secret", "reserialised", "tampered_after_signing", "truncated",
                                   "not_hex", "non_ascii", "empty", "whitespace", "other_keys_secret",
                                   "last_header_wins", "forged_feedback"])
        value, sig, extra = self._spoil_signature(variant, ev, value, sign(value, self.keys[kid]).encode())
        hdrs: Headers = [(KEY_ID_HEADER, kid.encode()), (SIGNATURE_HEADER, sig), *extra]
        return value, self._key_for(value), hdrs, "bad_signature", f"bad_signature/{variant}"

    def _spoil_signature(self, variant: str, ev: dict[str, Any], value: bytes, sig: bytes
                         ) -> tuple[bytes, bytes, Headers]:
        """(value, signature, extra headers) of one variant, from ``value`` and its good ``sig``.
        A variant that cannot apply (one key only, no valid requests) keeps the good signature."""
        if variant in _BAD_SIGNATURES:
            return value, _BAD_SIGNATURES[variant](value, sig), []
        if variant == "reserialised":  # signed compact, sent pretty: the bytes changed
            return json.dumps(ev, indent=1).encode(), sig, []
        if variant == "tampered_after_signing":
            return value.replace(b'"request_id":"', b'"request_id":"x', 1), sig, []
        if variant == "other_keys_secret" and len(self.keys) > 1:
            other = sorted(self.keys)[1]
            return value, sign(value, self.keys[other]).encode(), []
        if variant == "last_header_wins":  # a good signature followed by a bad one
            return value, sig, [(SIGNATURE_HEADER, b"0" * 64)]
        if variant == "forged_feedback" and self.targets:  # a reject aimed at a valid request
            forged = enc(self.event(type="edit.rejected", request_id=self.rng.choice(self.targets),
                                    inserted_chars=0))
            return forged, sign(forged, b"not-the-key").encode(), []
        return value, sig, []

    def not_utf8(self) -> Any:
        rng = self.rng
        variant = rng.choice(["ff_in_string", "latin1", "lone_surrogate_bytes", "overlong", "binary",
                              "utf16_bom", "truncated_multibyte", "cp1252_quotes"])
        ev = self.event()
        if variant == "ff_in_string":
            value = enc(ev).replace(b'"request_id":"', b'"request_id":"\xff', 1)
        elif variant == "latin1":
            value = json.dumps({**ev, "reason": "café"}, ensure_ascii=False).encode("latin-1")
        elif variant == "lone_surrogate_bytes":
            value = enc(ev).replace(b'"event_id":"', b'"event_id":"\xed\xa0\x80', 1)
        elif variant == "overlong":
            value = enc(ev).replace(b'"event_id":"', b'"event_id":"\xc0\xaf', 1)
        elif variant == "binary":
            value = b"\xff" + rng.randbytes(rng.randint(1, 300))
        elif variant == "utf16_bom":
            value = json.dumps(ev).encode("utf-16")
        elif variant == "truncated_multibyte":
            value = enc(ev).replace(b'"event_id":"', b'"event_id":"\xe2\x82', 1)
        else:
            value = enc(ev).replace(b'"event_id":"', b'"event_id":"\x93', 1)
        return self.signed(value, "not_utf8", f"not_utf8/{variant}", key=None)

    def bad_json(self) -> Any:
        rng = self.rng
        variant = rng.choice(list(_BAD_JSON))
        body = enc(self.event())
        value = _BAD_JSON[variant](body, rng)
        if value is None:
            return None, self.rid().encode(), self.sig(b""), "bad_json", f"bad_json/{variant}"
        return self.signed(value, "bad_json", f"bad_json/{variant}", key=None)

    def not_object(self) -> Any:
        variant = self.rng.choice(["array", "string", "number", "null", "true", "array_of_events", "float"])
        value = {
            "array": b"[1, 2]", "string": b'"completion.served"', "number": b"42", "null": b"null",
            "true": b"true", "float": b"-0.0", "array_of_events": enc([self.event(), self.event()]),
        }[variant]
        return self.signed(value, "not_object", f"not_object/{variant}", key=None)

    def unknown_schema_version(self) -> Any:
        variant, v = self.rng.choice([("v2", 2), ("v0", 0), ("negative", -1), ("string", "1"),
                                      ("null", None), ("fraction", 1.5), ("v1_text", "v1"), ("list", [1]),
                                      ("huge", 10**18), ("object", {"v": 1}), ("true", True)])
        value = enc(self.event(schema_version=v))
        return self.signed(value, "unknown_schema_version", f"unknown_schema_version/{variant}")

    def unknown_type(self) -> Any:
        variant, t = self.rng.choice([("unknown", "completion.deleted"), ("case", "Completion.Served"),
                                      ("null", None), ("number", 7), ("empty", ""),
                                      ("space", "edit.accepted "),
                                      ("list", ["edit.accepted"]), ("nul", "edit.accepted\u0000")])
        value = enc(self.event(type=t))
        return self.signed(value, "unknown_type", f"unknown_type/{variant}")

    def missing_field(self) -> Any:
        variant = self.rng.choice(["request_id", "event_id", "ts", "type", "empty_object", "type_only",
                                   "served_fields", "inserted_chars", "model_version"])
        if variant in ("request_id", "event_id", "ts", "type"):
            ev = self.event(**{variant: _DROP})
        elif variant == "empty_object":
            ev = {}
        elif variant == "type_only":
            ev = {"type": "edit.accepted"}
        elif variant == "served_fields":
            ev = self.served(**{})
            ev.pop(self.rng.choice(["session_id", "user_key", "model", "arm", "prompt_tokens",
                                    "completion_tokens", "logprobs", "latency_ms"]))
        elif variant == "inserted_chars":
            ev = self.event(type="edit.accepted")
            ev.pop("inserted_chars", None)
            ev.pop("horizon_s", None)
            ev.pop("retained_chars", None)
            ev.pop("reason", None)
            for k in ("session_id", "user_key", "model", "arm", "prompt_tokens", "completion_tokens",
                      "logprobs", "latency_ms", "tool_calls", "invalid_tool_calls"):
                ev.pop(k, None)
        else:
            ev = self.served(model={"name": "rtrl-policy"})
        return self.signed(enc(ev), "missing_field", f"missing_field/{variant}")

    def invalid_field(self) -> Any:
        rng = self.rng
        choices: list[tuple[str, Callable[[], dict[str, Any]]]] = [
            ("negative_latency", lambda: self.served(latency_ms=-1)),
            ("latency_too_large", lambda: self.served(latency_ms=3_600_001)),
            ("latency_string", lambda: self.served(latency_ms="fast")),
            ("token_negative", lambda: self.served(prompt_tokens=[-1])),
            ("token_too_large", lambda: self.served(prompt_tokens=[2**31])),
            ("token_float", lambda: self.served(completion_tokens=[1.5], logprobs=[-1.0])),
            ("token_string", lambda: self.served(prompt_tokens=["1"])),
            ("too_many_tokens", lambda: self.served(prompt_tokens=[1] * 32_769)),
            ("positive_logprob", lambda: self.served(logprobs=[0.5])),
            ("logprob_count", lambda: self.served(logprobs=[-0.1, -0.2])),
            ("invalid_tools", lambda: self.served(tool_calls=1, invalid_tool_calls=2)),
            ("negative_tools", lambda: self.served(tool_calls=-1)),
            ("arm_unknown", lambda: self.served(arm="blue")),
            ("kind_unknown", lambda: self.served(completion_kind="code")),
            ("model_not_object", lambda: self.served(model="rtrl-policy")),
            ("model_name_huge", lambda: self.served(model={"name": "m" * 201, "version": "1"})),
            ("request_id_int", lambda: self.event(request_id=5)),
            ("request_id_empty", lambda: self.event(request_id="")),
            ("request_id_too_long", lambda: self.event(request_id="r" * 129)),
            ("request_id_null", lambda: self.event(request_id=None)),
            ("request_id_nul_byte", lambda: self.event(request_id="r\u0000x")),
            ("request_id_homoglyph", lambda: self.event(request_id="rеq-1")),  # Cyrillic e
            ("request_id_emoji", lambda: self.event(request_id="r-🙂")),
            ("request_id_injection", lambda: self.event(request_id="r1'; DROP TABLE x;--")),
            ("event_id_path", lambda: self.event(event_id="../../etc/passwd")),
            ("extra_field", lambda: self.event(source_code="print('secret')")),
            ("giant_key", lambda: self.event(**{"k" * rng.choice([1_000, 10_000, 10_000, 100_000]): 1})),
            ("proto_pollution", lambda: self.event(__proto__={"admin": True})),
            ("deep_but_parseable", lambda: self.event(x=json.loads("[" * 100 + "]" * 100))),
            ("naive_ts", lambda: self.event(ts=self.now.replace(tzinfo=None).isoformat())),
            ("ts_garbage", lambda: self.event(ts="yesterday")),
            ("ts_feb_30", lambda: self.event(ts="2026-02-30T00:00:00Z")),
            ("ts_null", lambda: self.event(ts=None)),
            ("reason_too_long", lambda: self.event(type="followup.dissatisfied", reason="r" * 5_000)),
            ("retained_gt_inserted", lambda: self.event(type="edit.persistence", horizon_s=30,
                                                        retained_chars=9, inserted_chars=3)),
            ("horizon_zero", lambda: self.event(type="edit.persistence", horizon_s=0, retained_chars=1,
                                                inserted_chars=3)),
            ("horizon_too_long", lambda: self.event(type="edit.persistence", horizon_s=31 * 86_400,
                                                    retained_chars=1, inserted_chars=3)),
            ("negative_chars", lambda: self.event(type="edit.accepted", inserted_chars=-5)),
            ("chars_float", lambda: self.event(type="edit.accepted", inserted_chars=2.5)),
            ("chars_string", lambda: self.event(type="edit.accepted", inserted_chars="3")),
            ("chars_bool", lambda: self.event(type="edit.accepted", inserted_chars=True)),
            ("tools_bool", lambda: self.served(tool_calls=True, invalid_tool_calls=False)),
            ("latency_numeric_string", lambda: self.served(latency_ms="12.5")),
            ("ts_epoch_number", lambda: self.event(ts=int(self.now.timestamp()))),
            ("ts_before_year_1_utc", lambda: self.event(ts="0001-01-01T00:00:00+14:00")),
            ("ts_after_year_9999_utc", lambda: self.event(ts="9999-12-31T23:59:59-14:00")),
            ("tools_beyond_int64", lambda: self.served(tool_calls=rng.choice([2**63, 10**40, 10**300]))),
            ("invalid_tools_beyond_int64", lambda: self.served(tool_calls=2**63 - 1,
                                                               invalid_tool_calls=2**64)),
            ("chars_beyond_int64", lambda: self.event(type="edit.accepted", inserted_chars=2**63)),
            ("retained_beyond_int64", lambda: self.event(type="edit.persistence", horizon_s=60,
                                                         retained_chars=10**40, inserted_chars=10**41)),
        ]
        literal = [("nan_latency", "NaN"), ("infinite_latency", "Infinity"),
                   ("minus_infinity_logprob", "-Infinity"), ("float_overflow", "1e400")]
        if rng.random() < len(literal) / (len(literal) + len(choices)):
            variant, lit = rng.choice(literal)
            ev = self.served()
            if variant == "minus_infinity_logprob":
                body = enc(ev).replace(b'"logprobs":[-0.5]', b'"logprobs":[' + lit.encode() + b"]")
            else:
                body = enc(ev).replace(b'"latency_ms":10.0', b'"latency_ms":' + lit.encode())
            return self.signed(body, "invalid_field", f"invalid_field/{variant}")
        variant, make = rng.choice(choices)
        return self.signed(enc(make()), "invalid_field", f"invalid_field/{variant}")

    def duplicate_key(self) -> Any:
        """A valid event in which one object names a key twice (same or another value)."""
        rng = self.rng
        ev = self.event()
        body = enc(ev)
        variant = rng.choice(["request_id_other", "request_id_same", "type_twice", "event_id_other",
                              "ts_twice", "nested_model", "request_id_thrice", "escaped_spelling"])
        if variant == "nested_model":
            ev = self.served()
            body = enc(ev).replace(b'"version":"1"', b'"version":"1","version":"2"', 1)
        elif variant == "request_id_thrice":  # (an unknown key twice is an unknown field first)
            rid = json.dumps(ev["request_id"]).encode()
            body = body[:-1] + b',"request_id":' + rid + b',"request_id":' + rid + b"}"
        elif variant == "escaped_spelling":  # the same key spelled with a JSON escape
            body = body[:-1] + b',"request\u005fid":' + json.dumps(ev["request_id"]).encode() + b"}"
        else:
            key = {"request_id_other": "request_id", "request_id_same": "request_id", "type_twice": "type",
                   "event_id_other": "event_id", "ts_twice": "ts"}[variant]
            value = ev[key] if variant in ("request_id_same", "type_twice", "ts_twice") else f"{ev[key]}-2"
            body = body[:-1] + b"," + json.dumps(key).encode() + b":" + json.dumps(value).encode() + b"}"
        return self.signed(body, "duplicate_key", f"duplicate_key/{variant}")

    def ts_future(self) -> Any:
        variant, delta = self.rng.choice([("skew_15min", timedelta(minutes=15)),
                                          ("skew_1h", timedelta(hours=1)),
                                          ("next_year", timedelta(days=365))])
        ts = (self.now + delta).isoformat()
        if self.rng.random() < 0.2:
            variant, ts = "year_9999", "9999-12-31T23:59:59Z"
        elif self.rng.random() < 0.2:  # far ahead, written in another zone
            variant, ts = "other_zone", (self.now + timedelta(hours=2)).astimezone(_TZ_PLUS_5).isoformat()
        return self.signed(enc(self.event(ts=ts)), "ts_future", f"ts_future/{variant}")

    def ts_too_old(self) -> Any:
        variant, ts = self.rng.choice([("8_days", (self.now - timedelta(days=8)).isoformat()),
                                       ("epoch", "1970-01-01T00:00:00Z"), ("year_1", "0001-01-01T00:00:00Z"),
                                       ("last_year", (self.now - timedelta(days=365)).isoformat())])
        return self.signed(enc(self.event(ts=ts)), "ts_too_old", f"ts_too_old/{variant}")

    def key_mismatch(self) -> Any:
        ev = self.event()
        variant = self.rng.choice(["other_request", "giant_key", "empty_key", "non_utf8_key", "case_changed"])
        key = {
            "other_request": b"some-other-request",
            "giant_key": b"k" * self.rng.choice([2_000, 2_000, 2_000, 100_000]),
            "empty_key": b"",
            "non_utf8_key": b"\xff\xfe" + ev["request_id"].encode(),
            "case_changed": ev["request_id"].upper().encode() + b"X",
        }[variant]
        return self.signed(enc(ev), "key_mismatch", f"key_mismatch/{variant}", key=key)


class _Drop:
    pass


_DROP: Any = _Drop()

_TZ_PLUS_5 = timezone(timedelta(hours=5))


def enc(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


_BAD_SIGNATURES: dict[str, Callable[[bytes, bytes], bytes]] = {
    "wrong_secret": lambda value, sig: sign(value, b"guessed-secret").encode(),
    "truncated": lambda value, sig: sig[:32],
    "not_hex": lambda value, sig: b"z" * 64,
    "non_ascii": lambda value, sig: "é".encode() * 32,
    "empty": lambda value, sig: b"",
    "whitespace": lambda value, sig: b" " * 64,
}
"""Signatures that are wrong for an unchanged value: (value, its good signature) -> the one sent."""


def _deep_array(body: bytes, rng: random.Random) -> bytes:
    d = rng.randint(300, 20_000)
    return b"[" * d + b"]" * d


def _deep_object(body: bytes, rng: random.Random) -> bytes:
    d = rng.randint(300, 5_000)
    return b'{"a":' * d + b"1" + b"}" * d


def _deep_in_field(body: bytes, rng: random.Random) -> bytes:
    d = rng.randint(300, 5_000)
    return body[:-1] + b',"x":' + b"[" * d + b"]" * d + b"}"


def _number_out_of_range(body: bytes, rng: random.Random) -> bytes:
    return body[:-1] + b',"latency_ms":1' + b"0" * rng.randint(5_000, 8_000) + b"}"


_BAD_JSON: dict[str, Callable[[bytes, random.Random], bytes | None]] = {
    "truncated": lambda body, rng: body[: rng.randint(1, len(body) - 1)],
    "trailing_garbage": lambda body, rng: body + b" }",
    "bom": lambda body, rng: b"\xef\xbb\xbf" + body,
    "empty": lambda body, rng: b"",
    "tombstone": lambda body, rng: None,
    "single_quotes": lambda body, rng: body.replace(b'"', b"'"),
    "deep_array": _deep_array,
    "deep_object": _deep_object,
    "deep_in_field": _deep_in_field,
    "number_out_of_range": _number_out_of_range,
    "nul_byte": lambda body, rng: body[:10] + b"\x00" + body[10:],
    "json_lines": lambda body, rng: body + b"\n" + body,
    "comment": lambda body, rng: b"/* hi */" + body,
    "lone_surrogate_escape": lambda body, rng: body.replace(b'"request_id":"', b'"request_id":"\\ud800', 1),
    "whitespace": lambda body, rng: b" \n\t " * rng.randint(1, 100),
    "unquoted_keys": lambda body, rng: b"{event_id: 1}",
    "trailing_comma": lambda body, rng: body[:-1] + b",}",
    "nan_top_level_garbage": lambda body, rng: b"NaNx",
}
"""Bad JSON from a valid event's bytes (None: a tombstone). In the order the seeded draw picks
from (by position): never reorder."""


CATEGORIES: dict[str, float] = {
    "oversized": 0.04, "unsigned": 1, "unknown_key": 1, "bad_signature": 2, "not_utf8": 1, "bad_json": 2,
    "not_object": 0.5, "unknown_schema_version": 1, "unknown_type": 1, "missing_field": 1.5,
    "invalid_field": 4, "duplicate_key": 1, "ts_future": 1, "ts_too_old": 1, "key_mismatch": 1,
}
"""Relative weights of the bad categories (duplicates are added on top, from valid events)."""
DUPLICATE_SHARE = 0.04
"""Share of the bad records that are replays of valid events (exact or altered)."""


def build(seed: int, n_bad: int, n_valid_requests: int, now: datetime,
          keys: Mapping[str, bytes]) -> Corpus:
    """The corpus in send order. Every request's events keep their order; everything else is
    a seeded random interleaving."""
    rng = random.Random(seed)
    valid = _Valid(rng, now, keys, seed)
    plans = {p.served.request_id: p for p in (valid.plan(i) for i in range(n_valid_requests))}
    streams: list[list[Record]] = []
    n_dup = int(n_bad * DUPLICATE_SHARE) if plans else 0
    dup_for: Counter[str] = Counter(rng.choice(sorted(plans)) for _ in range(n_dup))
    for rid, plan in plans.items():
        recs = [valid.signed(ev) for ev in plan.events]
        for _ in range(dup_for[rid]):
            orig = rng.choice(recs[: len(plan.events)])
            if rng.random() < 0.5:  # a byte-identical replay (producer retry, or an attacker)
                recs.append(Record(orig.value, orig.key, orig.headers, "duplicate", "duplicate/exact",
                                   orig.event_id))
            else:  # same event_id, altered and validly signed: must not change the reward
                assert orig.value is not None
                doc = json.loads(orig.value)
                doc["ts"] = (now - timedelta(seconds=1)).isoformat()
                if doc["type"] == "completion.served":
                    doc["latency_ms"] = 0.0
                    doc["arm"] = "canary" if doc["arm"] == "stable" else "stable"
                else:
                    keep = ("schema_version", "event_id", "request_id", "ts")
                    doc = {k: v for k, v in doc.items() if k in keep}
                    doc.update(type="edit.accepted", inserted_chars=999)
                value = enc(doc)
                recs.append(Record(value, orig.key, valid.signed_headers(value), "duplicate",
                                   "duplicate/altered", orig.event_id))
        streams.append(recs)
    bad = _Bad(rng, now, keys, sorted(plans), seed)
    names = list(CATEGORIES)
    weights = [CATEGORIES[n] for n in names]
    for _ in range(n_bad - n_dup):
        value, key, hdrs, reason, case = getattr(bad, rng.choices(names, weights)[0])()
        streams.append([Record(value, key, hdrs, reason, case)])
    return Corpus(_interleave(streams, rng), plans)


def _interleave(streams: list[list[Record]], rng: random.Random) -> list[Record]:
    """A random merge that keeps each stream's own order."""
    queues = [list(reversed(s)) for s in streams if s]
    out: list[Record] = []
    while queues:
        i = rng.randrange(len(queues))
        q = queues[i]
        out.append(q.pop())
        if not q:
            queues[i] = queues[-1]
            queues.pop()
    return out
