"""The adaptive cadence: when an increment starts, and the record tally it looks at."""

from __future__ import annotations

import itertools
import random
from datetime import UTC, datetime

import pytest

from ingest.events import ModelRef, RewardRecord
from trainer.adapters.memory import InMemoryRewardLog
from trainer.cadence import Readiness, RecordTally, Trigger, decide, kish_ess
from trainer.window import plan_window

OFF = Trigger()
ON = Trigger(min_records=1000, min_ess=200)


@pytest.mark.parametrize(("due", "records", "ess", "canary", "trigger", "start", "why", "waiting_for"), [
    # the interval alone (the trigger off)
    (False, 10**6, 10**6, None, OFF, False, "", ""),
    (True, 0, 0, None, OFF, True, "interval", ""),
    # a canary in flight blocks every start: the candidate could not be offered
    (True, 5000, 900, "7", OFF, False, "", "canary"),
    (True, 5000, 900, "7", ON, False, "", "canary"),
    (False, 5000, 900, "7", ON, False, "", "canary"),
    # enough records and enough users start it early
    (False, 1000, 200, None, ON, True, "records", ""),
    (False, 5000, 900, None, ON, True, "records", ""),
    # enough records from too few users, or too few records, wait
    (False, 5000, 199.9, None, ON, False, "", "records"),
    (False, 999, 999, None, ON, False, "", "records"),
    # the interval wins over too few records
    (True, 3, 1, None, ON, True, "interval", ""),
])
def test_when_an_increment_starts(due: bool, records: int, ess: float, canary: str | None, trigger: Trigger,
                                  start: bool, why: str, waiting_for: str) -> None:
    d = decide(Readiness(due, records, ess, canary), trigger)
    assert (d.start, d.trigger, d.waiting_for) == (start, why, waiting_for)
    assert d.reason
    if waiting_for == "records":
        assert ("too few distinct users" in d.reason) == (records >= trigger.min_records)
    if canary is not None:
        assert f"v{canary}" in d.reason


def test_a_resting_records_trigger_waits_but_the_interval_does_not() -> None:
    assert not decide(Readiness(False, 5000, 900, None, resting=True), ON).start
    assert decide(Readiness(False, 5000, 900, None, resting=True), ON).waiting_for == "records"
    assert decide(Readiness(True, 5000, 900, None, resting=True), ON).trigger == "interval"
    assert not decide(Readiness(True, 5000, 900, "4", resting=True), ON).start


def test_the_rule_never_starts_during_a_canary_whatever_else_holds() -> None:
    for due, records, ess, mr, me in itertools.product([True, False], [0, 10, 10**6], [0.0, 5.0, 1e6],
                                                       [0, 1, 10**5], [0.0, 1.0, 1e5]):
        assert not decide(Readiness(due, records, ess, "3"), Trigger(mr, me)).start
        expected = due or (mr > 0 and records >= mr and ess >= me)
        assert decide(Readiness(due, records, ess, None), Trigger(mr, me)).start == expected


def _kish_reference(users: list[str]) -> float:
    """Plain definition: (number of records)^2 / sum over users of (their records)^2."""
    per_user: dict[str, int] = {}
    for u in users:
        per_user[u] = per_user.get(u, 0) + 1
    return len(users) ** 2 / sum(n * n for n in per_user.values()) if users else 0.0


def test_kish_ess_against_the_plain_definition() -> None:
    assert kish_ess([]) == 0.0
    assert kish_ess([10_000]) == 1.0, "one user is one sample"
    assert kish_ess([1] * 500) == 500.0
    rng = random.Random(3)
    for _ in range(200):
        users = [f"u{int(rng.paretovariate(1.2))}" for _ in range(rng.randint(1, 300))]
        counts: dict[str, int] = {}
        for u in users:
            counts[u] = counts.get(u, 0) + 1
        assert kish_ess(counts.values()) == pytest.approx(_kish_reference(users))
        assert 1.0 <= kish_ess(counts.values()) <= len(users)


def _record(i: int, user: str, version: str = "1") -> bytes:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    return RewardRecord(
        request_id=f"r{i}", served_event_id=f"e{i}", session_id="s", user_key=user, served_ts=now,
        closed_ts=now, model=ModelRef(name="rtrl-policy", version=version), arm="stable",
        prompt_tokens=[0, 5], completion_tokens=[7, 1], behavior_logprobs=[-1.0, -0.5],
        latency_ms=10.0, reward=1.0, components={"accept": 1.0}, reward_spec_version="v1",
    ).model_dump_json().encode()


class CountingLog(InMemoryRewardLog):
    """Counts the values read, to show each record is read once."""

    reads = 0

    def read(self, window):  # type: ignore[no-untyped-def]
        for item in super().read(window):
            self.reads += 1
            yield item


def test_the_tally_reads_each_record_once_and_restarts_at_a_new_cut() -> None:
    log = CountingLog("rewards")
    for i in range(6):
        log.append(i % 2, _record(i, f"u{i % 3}"))
    log.append(0, b"not a record")
    tally = RecordTally("rewards")
    tally.update(log)
    assert tally.figures() == (6, pytest.approx(kish_ess([2, 2, 2])))
    assert tally.invalid == 1 and log.reads == 7
    tally.update(log)
    assert log.reads == 7, "nothing new: nothing read"
    for i in range(6, 10):
        log.append(1, _record(i, "u0", version="2"))
    tally.update(log)
    assert log.reads == 11 and tally.figures()[0] == 10
    # the rule of train_on=champions: v2's records do not count while it is not a champion
    assert tally.figures(lambda v: v == "1") == (6, pytest.approx(3.0))
    # an increment commits a window: the tally starts again after the new cut
    log.commit(plan_window("rewards", {}, {0: 0, 1: 0}, {0: 4, 1: 5}))
    tally.update(log)
    assert tally.figures() == (2, 1.0) and tally.invalid == 0  # partition 1 offsets 5-6: u0 twice


def test_records_served_during_a_canary_count_once_it_is_promoted() -> None:
    log = InMemoryRewardLog("rewards", partitions=1)
    for i in range(4):
        log.append(0, _record(i, f"u{i}", version="1" if i < 2 else "5"))
    tally = RecordTally("rewards")
    tally.update(log)
    champions = {"1"}
    assert tally.figures(lambda v: v in champions)[0] == 2
    champions.add("5")  # the canary of v5 was promoted: its arm's records are trainable now
    assert tally.figures(lambda v: v in champions)[0] == 4

