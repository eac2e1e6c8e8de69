"""The increment's bounded retry of registry calls after training (trainer.registry_retry_s).
The real-server test (no duplicate version, window pending past the budget) is
tests/reliability/test_mlflow_outage.py."""

from __future__ import annotations

import pytest

from trainer.registration import Retrying


def test_retry_returns_after_failures_and_reports_each() -> None:
    seen: list[BaseException] = []
    pauses: list[float] = []
    calls = iter([ConnectionError("a"), ConnectionError("b"), "ok"])

    def fn() -> str:
        item = next(calls)
        if isinstance(item, BaseException):
            raise item
        return item

    retry = Retrying(60.0, seen.append, sleep=pauses.append)
    assert retry("call", fn) == "ok"
    assert len(seen) == 2 and retry.failures == 2 and pauses == [1.0, 2.0]


def test_retry_gives_up_after_the_budget() -> None:
    retry = Retrying(0.0, sleep=lambda _s: None)
    with pytest.raises(ConnectionError):
        retry("call", lambda: (_ for _ in ()).throw(ConnectionError("down")))
