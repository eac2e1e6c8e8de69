"""Operator identity: keys, signatures and the deployer's verification of queued commands
(deployer/operators.py), and what a refused command leaves behind."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import pytest

from deployer.adapters.memory import FakeWorld
from deployer.ledger import TAG_DECIDED_BY, TAG_OUTCOME, TAG_REASON
from deployer.operators import (
    Authority,
    as_verified,
    key_line,
    parse_keys,
    screen,
    sign,
    verify,
)
from deployer.status import CanaryPolicy, Command, Phase, Refusal
from ingest.contracts.registry import TAG_CLAIMED_BY, TAG_KIND
from services.runtime.operator_keys import authority
from services.settings.operators import OperatorSettings

NOW = 1_800_000_000.0
KEYS = parse_keys(key_line("alice", "alice-token") + "\n" + key_line("bob", "bob-token"))
AUTH = Authority(KEYS, max_age_s=300.0)


def promote(by: str = "alice", version: str = "2", cid: str = "c1") -> Command:
    return Command(id=cid, kind="promote", by=by, version=version, reason="hotfix")


def result(cmd: Command, auth: Authority = AUTH, now: float = NOW, seen: bool = False) -> str:
    return verify(cmd, auth, now, seen).result


def test_a_command_signed_with_the_operators_token_is_accepted_as_that_operator() -> None:
    v = verify(sign(promote(), "alice-token", NOW), AUTH, NOW + 5, seen=False)
    assert (v.result, v.operator, v.ok) == ("accepted", "alice", True)


def test_a_wrong_token_is_a_bad_signature() -> None:
    assert result(sign(promote(), "bob-token", NOW)) == "bad_signature"
    assert result(sign(promote(), "guess", NOW)) == "bad_signature"


def test_every_signed_field_is_covered() -> None:
    signed = sign(promote(), "alice-token", NOW)
    for change in ({"version": "3"}, {"kind": "rollback"}, {"reason": "other"}, {"ts": NOW + 1},
                   {"id": "c2"}, {"by": "bob"}):
        assert result(replace(signed, **change)) in ("bad_signature",), change  # type: ignore[arg-type]


def test_an_operator_without_a_key_is_unknown() -> None:
    assert result(sign(promote(by="mallory"), "alice-token", NOW)) == "unknown_operator"


def test_an_old_or_future_dated_command_is_expired() -> None:
    signed = sign(promote(), "alice-token", NOW)
    assert result(signed, now=NOW + 299) == "accepted"
    assert result(signed, now=NOW + 301) == "expired"
    assert result(signed, now=NOW - 301) == "expired"


def test_a_command_seen_before_is_a_replay() -> None:
    signed = sign(promote(), "alice-token", NOW)
    assert result(signed, seen=True) == "replayed"


def test_unsigned_commands_are_refused_unless_explicitly_allowed() -> None:
    assert result(promote()) == "unsigned"
    assert result(promote(), auth=Authority({})) == "no_keys"
    assert "no operator keys configured" in verify(promote(), Authority({}), NOW, False).message
    lax = Authority({}, allow_unauthenticated=True)
    v = verify(promote(), lax, NOW, False)
    assert v.result == "unauthenticated" and v.ok
    cmd = as_verified(promote(by="carol"), v)
    assert cmd.by == "unauthenticated" and cmd.reason == "hotfix [unauthenticated; claimed by carol]"


def test_a_command_the_machine_does_not_know_is_refused_even_when_signed() -> None:
    odd = sign(Command(id="c9", kind="delete_everything", by="alice"), "alice-token", NOW)  # type: ignore[arg-type]
    assert result(odd) == "unknown_command"
    lax = Authority({}, allow_unauthenticated=True)
    assert result(replace(odd, signature=""), auth=lax) == "unknown_command"


def test_unreadable_keys_refuse_every_command() -> None:
    broken = Authority(KEYS, error="no such file")
    assert result(sign(promote(), "alice-token", NOW), auth=broken) == "no_keys"


def test_keys_as_lines_or_json_and_several_per_operator_while_rotating() -> None:
    old, new = (hashlib.sha256(t.encode()).hexdigest() for t in ("old", "new"))
    text = f"# operators\n\nalice:{old}\nalice:{new}\nbob:{new.upper()}\n"
    keys = parse_keys(text)
    assert keys == parse_keys(json.dumps({"alice": [old, new], "bob": new}))
    rotating = Authority(keys)
    assert result(sign(promote(), "old", NOW), auth=rotating) == "accepted"
    assert result(sign(promote(), "new", NOW), auth=rotating) == "accepted"
    assert result(sign(promote(by="bob"), "new", NOW), auth=rotating) == "accepted"


@pytest.mark.parametrize(("text", "why"), [
    ("alice", "line 1: expected name:sha256-hex"),
    ("alice:abc", "must be 64 hex digits"),
    ("al ice:" + "0" * 64, "operator name"),
])
def test_malformed_keys_say_what_is_wrong(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_keys(text)


def test_authority_reads_the_keys_file_and_reports_a_broken_one(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(key_line("alice", "alice-token") + "\n")
    inline = key_line("bob", "bob-token")
    auth = authority(OperatorSettings(keys_file=path, keys=inline, max_age_s=60))  # type: ignore[arg-type]
    assert set(auth.keys) == {"alice", "bob"} and auth.max_age_s == 60 and not auth.error
    path.write_text("alice:nothex\n")
    assert "64 hex digits" in authority(OperatorSettings(keys_file=path)).error
    assert "No such file" in authority(OperatorSettings(keys_file=tmp_path / "gone")).error


def test_screen_passes_verified_commands_on_and_refusals_aside() -> None:
    good = sign(promote(cid="a"), "alice-token", NOW)
    forged = replace(sign(promote(cid="b"), "alice-token", NOW), version="3")
    again = sign(promote(cid="c"), "alice-token", NOW)
    done = Command(id="d", kind="pause", by="alice")  # handled before a restart: not re-verified
    out = screen([good, forged, again, done], handled={"d"}, auth=AUTH, now=NOW, seen={"c"})
    assert [c.id for c in out.accepted] == ["a", "d"] and out.accepted[0].by == "alice"
    assert [(r.command.id, r.why) for r in out.refused] == [
        ("b", "bad signature for operator 'alice'"), ("c", "command c was already executed")]
    assert out.counts == (("promote", "accepted"), ("promote", "bad_signature"), ("promote", "replayed"))


def test_a_refused_command_is_recorded_and_never_executed() -> None:
    w = FakeWorld(policy=CanaryPolicy(steps=(0.1,), bake_s=60))
    w.register("1", alias="champion")
    w.register("2")
    forged = Refusal(Command(id="x1", kind="promote", by="mallory", version="2"),
                     "unknown operator 'mallory'")
    w.tick(refused=(forged,))
    assert w.status.phase == Phase.IDLE and w.registry.aliases == {"champion": "1"}
    assert w.status.handled == (("x1", "refused: unknown operator 'mallory'"),)
    record = w.ledger.runs["refused-x1"]
    assert record.closed and record.tags[TAG_OUTCOME] == "refused"
    assert record.tags[TAG_KIND] == "refused_command" and record.tags[TAG_CLAIMED_BY] == "mallory"
    assert record.tags[TAG_DECIDED_BY] == "controller"
    assert record.tags[TAG_REASON] == "refused promote v2 claimed by mallory: unknown operator 'mallory'"
    w.tick(refused=(forged,))  # still queued on the next tick: recorded once
    assert len(w.status.handled) == 1


def test_a_refusal_during_a_canary_is_noted_on_its_ledger_run() -> None:
    w = FakeWorld(policy=CanaryPolicy(steps=(0.1,), bake_s=60))
    w.register("1", alias="champion")
    w.register("2", alias="candidate")
    w.tick(), w.tick()
    forged = Refusal(Command(id="x2", kind="rollback", by="alice"), "bad signature for operator 'alice'")
    w.tick("continue", refused=(forged,))
    assert w.status.phase == Phase.PROGRESSING
    canary = w.ledger.runs[w.status.canary_id or ""]
    assert canary.tags["rtrl.operator.x2"].startswith("refused rollback claimed by alice")
