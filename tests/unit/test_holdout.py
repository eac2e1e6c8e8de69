"""The long-term holdout's rules (deployer/holdout.py, deployer/routing.py) as table tests."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from deployer import holdout
from deployer.actions import EngineLoad, LedgerClose, LedgerOpen, SetHoldout
from deployer.adapters.memory import FakeEngine, FakeWorld
from deployer.canary import engine_upkeep
from deployer.engine import FAILED, EngineState
from deployer.operators import Authority, key_of, payload, sign, verify
from deployer.routing import Holdout, RoutingTable, bucket, parse_holdout, parse_table
from deployer.status import CanaryStatus, Command, Observations
from ingest.contracts.registry import TAG_HOLDOUT_END
from rollback.types import MetricEvidence

NOW = 1_800_000_000.0
DAY = 86400.0
H = Holdout(id="holdout-v1-c0ffee", version="1", share=0.1, salt="holdout-salt", started_at=NOW - DAY,
            until=NOW + DAY, by="alice")
USERS = [f"user-{i}" for i in range(20_000)]


# ---------------------------------------------------------------------------- parsing
@pytest.mark.parametrize(("raw", "problem"), [
    (None, ""),
    ("", ""),
    ("not json", "unreadable"),
    ("[1, 2]", "unreadable"),
    (json.dumps({"id": "h", "version": "1"}), "unreadable"),
    (json.dumps({**json.loads(H.to_text()), "share": 0.0}), "outside"),
    (json.dumps({**json.loads(H.to_text()), "share": 0.6}), "outside"),
    (json.dumps({**json.loads(H.to_text()), "share": "NaN"}), "outside"),
    (json.dumps({**json.loads(H.to_text()), "share": "lots"}), "unreadable"),
    (json.dumps({**json.loads(H.to_text()), "until": NOW - 2 * DAY}), "empty"),
    (json.dumps({**json.loads(H.to_text()), "salt": ""}), "no version or salt"),
])
def test_a_bad_holdout_value_holds_nobody_out(raw: str | None, problem: str) -> None:
    h, why = parse_holdout(raw)
    assert h is None
    assert (problem in why) if problem else why == ""
    table = parse_table({"holdout": raw, "canary_version": "2", "canary_weight": "0.5", "salt": "s"})
    assert table.holdout is None
    assert all(table.arm_for(u, True, True, NOW) != "holdout" for u in USERS[:500])


def test_a_holdout_round_trips_through_its_redis_value() -> None:
    assert parse_holdout(H.to_text()) == (H, "")
    assert parse_holdout(H.to_text().encode()) == (H, "")


# ---------------------------------------------------------------------------- assignment
def test_the_held_out_share_is_sticky_and_about_the_share() -> None:
    held = [u for u in USERS if H.holds(u, NOW)]
    assert abs(len(held) / len(USERS) - H.share) < 0.01
    assert held == [u for u in USERS if bucket(u, H.salt) < 1000]  # the documented rule
    assert held == [u for u in USERS if H.holds(u, NOW + 3600)]


@pytest.mark.parametrize(("now", "active"), [
    (H.started_at - 1, False), (H.started_at, True), (H.until - 1, True), (H.until, False),
])
def test_only_an_active_holdout_holds_users(now: float, active: bool) -> None:
    assert H.active(now) is active
    assert any(H.holds(u, now) for u in USERS[:200]) is active


def test_held_out_users_never_see_the_canary_and_the_rest_are_split() -> None:
    table = RoutingTable(canary_weight=0.5, salt="canary-salt", stable_version="2", canary_version="3",
                         holdout=H)
    arms = {u: table.arm_for(u, canary_available=True, holdout_available=True, now=NOW) for u in USERS}
    held = {u for u in USERS if H.holds(u, NOW)}
    assert {u for u, a in arms.items() if a == "holdout"} == held
    rest = [a for u, a in arms.items() if u not in held]
    assert abs(rest.count("canary") / len(rest) - 0.5) < 0.02
    # the holdout's version not loaded yet: its users get stable, never the canary
    waiting = {table.arm_for(u, canary_available=True, holdout_available=False, now=NOW) for u in held}
    assert waiting == {"stable"}
    # expired: everyone is split as if there were no holdout
    later = {u: table.arm_for(u, True, True, H.until) for u in held}
    assert "holdout" not in later.values() and "canary" in later.values()


# ---------------------------------------------------------------------------- the command rules
def req(kind: str, **kw: object) -> holdout.Request:
    return holdout.Request(kind=kind, command_id="cmd-1", by="bob", **kw)  # type: ignore[arg-type]


EXPIRED = replace(H, until=NOW - 1)


@pytest.mark.parametrize(("request_", "current", "champion", "gate", "expect"), [
    # pin
    (req("holdout_pin"), None, "5", {}, "pinned new: 5.0% of users on v5"),
    (req("holdout_pin", version="3", share=0.2, days=30), None, "5", {"3": "pass"},
     "pinned new: 20.0% of users on v3"),
    (req("holdout_pin", version="3"), None, "5", {"3": "fail"}, "rejected: v3 has gate result fail"),
    (req("holdout_pin", version="3"), None, "5", {}, "rejected: v3 has gate result missing"),
    (req("holdout_pin"), None, None, {}, "rejected: no champion to pin"),
    (req("holdout_pin"), H, "5", {}, "rejected: holdout holdout-v1-c0ffee is active"),
    (req("holdout_pin"), EXPIRED, "5", {}, "pinned new"),
    (req("holdout_pin", share=0.0), None, "5", {}, "rejected: share 0 must lie in (0, 0.5]"),
    (req("holdout_pin", share=0.51), None, "5", {}, "rejected: share 0.51 must lie"),
    (req("holdout_pin", share=-0.1), None, "5", {}, "rejected: share -0.1 must lie"),
    (req("holdout_pin", share=math.nan), None, "5", {}, "rejected: share nan must lie"),
    (req("holdout_pin", share=0.00001), None, "5", {}, "rejected: share 1e-05 rounds to no user"),
    (req("holdout_pin", days=0.0), None, "5", {}, "rejected: days 0 must lie"),
    (req("holdout_pin", days=400.0), None, "5", {}, "rejected: days 400 must lie"),
    (req("holdout_pin", days=math.inf), None, "5", {}, "rejected: days inf must lie"),
    # rotate
    (req("holdout_rotate"), H, "5", {}, "rotated holdout-v1-c0ffee into new: 10.0% of users on v5"),
    (req("holdout_rotate", version="1", share=0.05), H, "5", {"1": "pass"}, "rotated holdout-v1-c0ffee"),
    (req("holdout_rotate"), None, "5", {}, "rejected: no holdout is active; pin one first"),
    (req("holdout_rotate"), EXPIRED, "5", {}, "rejected: no holdout is active"),
    # end
    (req("holdout_end"), H, "5", {}, "ended holdout holdout-v1-c0ffee (v1, 10.0% of users)"),
    (req("holdout_end"), None, "5", {}, "rejected: no holdout is active"),
    (req("holdout_end"), EXPIRED, "5", {}, "rejected: no holdout is active"),
    (req("holdout_dance"), None, "5", {}, "rejected: unknown holdout command"),
])
def test_command_rules(request_: holdout.Request, current: Holdout | None, champion: str | None,
                       gate: dict[str, str], expect: str) -> None:
    planned = holdout.plan(request_, current, champion, gate, NOW, "new")
    assert planned.result.startswith(expect), planned.result
    if planned.rejected:
        assert planned.after is None and planned.before is None
    elif request_.kind == "holdout_end":
        assert planned.before == current and planned.after is None


def test_pin_and_rotate_set_what_was_asked() -> None:
    pinned = holdout.plan(req("holdout_pin", share=0.2, days=30), None, "5", {}, NOW, "new").after
    assert pinned == Holdout(id="new", version="5", share=0.2, salt=holdout.salt_of("cmd-1"),
                             started_at=NOW, until=NOW + 30 * DAY, by="bob")
    rotated = holdout.plan(replace(req("holdout_rotate"), command_id="cmd-2"), H, "7", {}, NOW, "r").after
    assert rotated is not None
    assert (rotated.version, rotated.share, rotated.until - rotated.started_at) == ("7", H.share, 2 * DAY)
    assert rotated.salt != H.salt and rotated.started_at == NOW  # new users, new start


# ---------------------------------------------------------------------------- in the controller
def obs(current: Holdout | None = None, engine: dict[str, EngineState] | None = None,
        now: float = NOW) -> Observations:
    return Observations(now=now, champion="5", candidate=None, gate={"3": "pass"}, holdout=current,
                        engine=engine)


def cmd(kind: str, **kw: object) -> Command:
    return Command(id="c0ffee00aa11bb22", kind=kind, by="bob", **kw)  # type: ignore[arg-type]


def test_a_pin_writes_the_ledger_before_the_routing_key_and_a_retry_repeats_nothing() -> None:
    actions, result = holdout.handle(obs(), cmd("holdout_pin", version="3"))
    assert result.startswith("pinned holdout-v3-c0ffee00aa11")
    assert [type(a) for a in actions] == [LedgerOpen, SetHoldout]
    new = actions[-1].holdout  # type: ignore[union-attr]
    assert new is not None and new.id == actions[0].canary_id == "holdout-v3-c0ffee00aa11"
    again, said = holdout.handle(obs(current=new), cmd("holdout_pin", version="3"))
    assert again == [] and "in force" in said


def test_rotate_and_end_close_the_old_ledger_run() -> None:
    actions, _ = holdout.handle(obs(H), cmd("holdout_rotate"))
    assert [type(a) for a in actions] == [LedgerOpen, LedgerClose, LedgerOpen, SetHoldout]
    assert actions[1].canary_id == H.id and actions[2].canary_id != H.id  # type: ignore[union-attr]
    actions, _ = holdout.handle(obs(H), cmd("holdout_end", reason="quarter over"))
    assert [type(a) for a in actions] == [LedgerOpen, LedgerClose, SetHoldout]
    assert actions[-1] == SetHoldout(None)
    assert "quarter over" in actions[1].tags[TAG_HOLDOUT_END]  # type: ignore[union-attr]


def test_with_an_engine_the_pinned_version_is_loaded_before_any_traffic() -> None:
    actions, _ = holdout.handle(obs(engine={}), cmd("holdout_pin", version="3"))
    assert actions[0] == EngineLoad("3", required=True) and isinstance(actions[-1], SetHoldout)
    failed = {"3": EngineState(FAILED, "adapter missing")}
    actions, result = holdout.handle(obs(engine=failed), cmd("holdout_pin", version="3"))
    assert actions == [] and result == "rejected: v3 cannot be served by the engine: adapter missing"


def test_an_expired_holdout_is_ended_once_unless_a_command_replaced_it() -> None:
    assert holdout.upkeep(obs(H), []) == []
    ended = holdout.upkeep(obs(EXPIRED), [])
    assert [type(a) for a in ended] == [LedgerOpen, LedgerClose, SetHoldout] and ended[-1] == SetHoldout(None)
    assert holdout.upkeep(obs(EXPIRED), [SetHoldout(H)]) == []
    pinned, _ = holdout.handle(obs(EXPIRED), cmd("holdout_pin"))
    assert [type(a) for a in pinned] == [LedgerOpen, LedgerClose, LedgerOpen, SetHoldout]


def test_the_engine_keeps_the_holdouts_version_loaded_while_it_is_active() -> None:
    engine = {v: EngineState("ready", model=f"m{v}") for v in ("1", "5", "9")}
    actions = engine_upkeep(CanaryStatus(), obs(H, engine))
    assert EngineLoad("1") in actions and EngineLoad("5") in actions
    assert [a.version for a in actions if type(a).__name__ == "EngineUnload"] == ["9"]  # type: ignore[attr-defined]
    after = engine_upkeep(CanaryStatus(), obs(H, engine, now=H.until))
    assert {a.version for a in after if type(a).__name__ == "EngineUnload"} == {"1", "9"}  # type: ignore[attr-defined]


def test_holdout_commands_run_through_the_state_machine_in_any_phase() -> None:
    w = FakeWorld(engine=FakeEngine())
    w.register("1", alias="champion")
    w.register("2", alias="candidate")
    w.tick()
    assert w.status.phase.value in ("pending", "progressing")
    st = w.tick(commands=(cmd("holdout_pin", share=0.2),))
    assert dict(st.handled)["c0ffee00aa11bb22"].startswith("pinned holdout-v1-")
    table = parse_table(w.routing.read())
    assert table.holdout is not None and table.holdout.share == 0.2 and table.holdout.version == "1"
    run = w.ledger.runs[table.holdout.id]
    assert run.tags["rtrl.canary.kind"] == "holdout" and not run.closed
    w.now = table.holdout.until
    w.tick()
    assert parse_table(w.routing.read()).holdout is None
    assert run.closed and "expired" in run.tags[TAG_HOLDOUT_END]


# ---------------------------------------------------------------------------- signatures
def test_holdout_commands_sign_their_share_and_days_and_others_sign_as_before() -> None:
    plain = Command(id="i", kind="pause", by="al", ts=5.0)
    assert payload(plain) == b'["rtrl-operator-v1","i","pause","al",null,"",' + b'"5.0"]'
    auth = Authority(keys={"al": (key_of("tok"),)})
    signed = sign(Command(id="j", kind="holdout_pin", by="al", share=0.1, days=7.0), "tok", NOW)
    assert verify(signed, auth, NOW, seen=False).ok
    for forged in (replace(signed, share=0.5), replace(signed, days=365.0)):
        assert verify(forged, auth, NOW, seen=False).result == "bad_signature"


# ---------------------------------------------------------------------------- the effect
def evidence(metric: str, base: float, champ: float, status: str = "better") -> MetricEvidence:
    d = champ - base
    return MetricEvidence(metric, "higher_is_better", base, champ, d, d - 0.01, d + 0.01, 0.01, 300, 2700,
                          0.03, status)  # type: ignore[arg-type]


def test_effects_are_champion_minus_holdout_with_the_relative_change() -> None:
    found = holdout.effects([evidence("persistence", 0.5, 0.6), evidence("latency_tail", 1, 2),
                             evidence("reward", 0.0, 0.1), evidence("acceptance", 0.5, 0.5, "insufficient")])
    assert [e.metric for e in found] == ["persistence", "reward"]
    assert found[0].relative == pytest.approx(0.2) and math.isnan(found[1].relative)
    assert (found[0].users_holdout, found[0].users_champion) == (300, 2700)
    metrics = holdout.step_metrics(found)
    assert metrics["holdout.persistence.relative"] == pytest.approx(0.2)
    assert "holdout.reward.relative" not in metrics  # not finite: left out
    rep = holdout.report(H, "5", NOW - 60, NOW, found, 0.99)
    doc = json.loads(json.dumps(rep, allow_nan=False))  # strict JSON for rtrl status --json
    assert doc["champion"] == "5" and doc["effects"]["reward"]["relative"] is None
    assert doc["effects"]["persistence"]["lower"] == pytest.approx(0.09)


@pytest.mark.parametrize(("base", "champ", "expected"), [
    (-1.531, -1.078, "+29.6%"),  # a negative reward that rose: an improvement, shown as a rise
    (-1.078, -1.531, "-42.0%"),
    (0.5, 0.6, "+20.0%"),
    (600.0, 540.0, "-10.0%"),
])
def test_the_relative_change_keeps_the_direction_of_the_change_on_any_baseline(
        base: float, champ: float, expected: str) -> None:
    (effect,) = holdout.effects([evidence("reward", base, champ)])
    assert math.copysign(1, effect.relative) == math.copysign(1, champ - base)
    text = holdout.description({}, holdout.step_metrics([effect]))
    assert f"({expected}, interval" in text, text


# ---------------------------------------------------------------------------- what operators read
def test_status_and_holdout_cli_render_the_holdout_and_its_effect() -> None:
    from services.cli.holdout import render
    from services.cli.operator import render_holdout

    assert render_holdout(None, NOW) == "holdout      none pinned"
    line = render_holdout(H, NOW)
    assert line.startswith("holdout      holdout-v1-c0ffee: 10.0% of users on v1, until ")
    assert line.endswith("(rtrl holdout)")
    assert "expired at" in render_holdout(H, H.until)
    assert render(None, None, NOW).startswith("holdout      none pinned")
    doc = json.loads(H.to_text())
    assert "not measured yet" in render(doc, None, NOW)
    found = holdout.effects([evidence("persistence", 0.4, 0.5)])
    rep = holdout.report(H, "5", NOW - 600, NOW - 30, found, 0.99)
    rep["users"] = {"holdout": 300, "champion": 2700}
    text = render(doc, rep, NOW)
    assert "champion v5 vs holdout v1" in text and "2,700 vs 300 users; measured 0m30s ago" in text
    assert "persistence          0.400     0.500   +25.0%   [0.090, 0.110]" in text
    assert "99.0% always-valid interval" in text
    assert "not measured yet" in render(doc, {**rep, "holdout_id": "another"}, NOW)
