"""Decision notifications: which ticks announce a decision, the bodies and their signature,
and the sender's queue, retries and drops (with a fake poster; the real HTTP path is
tests/integration/test_deployer_notify.py)."""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
from dataclasses import replace

import pytest
from pydantic import ValidationError

from deployer import notify
from deployer.adapters.webhook import WebhookNotifier
from deployer.status import CanaryStatus, Phase
from services.settings.notify import NotifySettings

T = 1_800_000_000.0
RUNNING = CanaryStatus(phase=Phase.PROGRESSING, canary_id="canary-v7-x", candidate="7", stable="6")


def decided(phase: Phase, outcome: str, **kw: object) -> CanaryStatus:
    return replace(RUNNING, phase=phase, outcome=outcome, reason="judge: reward worse by 0.2",
                   decided_by="controller", **kw)  # type: ignore[arg-type]


def notice(outcome: str = "rolled_back", **kw: object) -> notify.Notice:
    phase = {"promoted": Phase.SUCCEEDED, "rolled_back": Phase.ROLLED_BACK, "aborted": Phase.ABORTED}[outcome]
    n = notify.notice_of(RUNNING, decided(phase, outcome, **kw), T, "rtrl-policy", "https://mlflow.example/")
    assert n is not None
    return n


@pytest.mark.parametrize(("phase", "outcome"), [(Phase.SUCCEEDED, "promoted"),
                                                (Phase.ROLLED_BACK, "rolled_back"),
                                                (Phase.ABORTED, "aborted")])
def test_a_tick_that_ends_a_canary_makes_one_notice(phase: Phase, outcome: str) -> None:
    after = decided(phase, outcome)
    n = notify.notice_of(RUNNING, after, T)
    assert n is not None and n.outcome == outcome and n.canary_id == "canary-v7-x"
    assert n.candidate == "7" and n.stable == "6" and n.decided_at == "2027-01-15T08:00:00Z"
    finishing = replace(after, phase=Phase.ROLLING_BACK if outcome != "promoted" else Phase.PROMOTING)
    assert notify.notice_of(finishing, after, T) is not None, "the finishing tick also decides"
    assert notify.notice_of(after, after, T) is None, "a replayed tick that changed nothing is quiet"


def test_ticks_without_a_decision_are_quiet() -> None:
    assert notify.notice_of(CanaryStatus(), replace(RUNNING, phase=Phase.PENDING), T) is None
    assert notify.notice_of(RUNNING, replace(RUNNING, step=2), T) is None
    deciding = replace(RUNNING, phase=Phase.ROLLING_BACK, outcome="rolled_back")
    assert notify.notice_of(RUNNING, deciding, T) is None, "announced once it is done"


def test_json_body_carries_the_decision_and_its_links() -> None:
    doc = json.loads(notify.body(notice(), "json"))
    assert doc["event"] == "rtrl.canary.decision" and doc["decision"] == "rollback"
    assert doc["outcome"] == "rolled_back" and doc["reason"] == "judge: reward worse by 0.2"
    assert doc["summary"] == "rolled back v7; v6 stays champion"
    assert doc["links"] == {"v7 in MLflow": "https://mlflow.example/#/models/rtrl-policy/versions/7",
                            "v6 in MLflow": "https://mlflow.example/#/models/rtrl-policy/versions/6"}
    assert notify.notice_of(RUNNING, decided(Phase.ABORTED, "aborted"), T, "rtrl-policy").links == {}


def test_slack_body_is_one_text_field() -> None:
    doc = json.loads(notify.body(notice("promoted"), "slack"))
    assert list(doc) == ["text"]
    assert "promoted v7 to champion (was v6)" in doc["text"]
    assert "<https://mlflow.example/#/models/rtrl-policy/versions/7|v7 in MLflow>" in doc["text"]
    restore = notice("rolled_back", kind="manual_rollback")
    assert "restored v7 as champion" in json.loads(notify.body(restore, "slack"))["text"]


def test_signature_is_hmac_sha256_of_the_exact_body() -> None:
    data = notify.body(notice(), "json")
    expected = "sha256=" + hmac.new(b"k3y", data, hashlib.sha256).hexdigest()
    assert notify.signature(b"k3y", data) == expected
    assert notify.verify(b"k3y", data, expected)
    assert not notify.verify(b"other", data, expected)
    assert not notify.verify(b"k3y", data + b" ", expected)


def test_backoff_doubles_up_to_a_cap_and_only_transient_failures_retry() -> None:
    assert [notify.backoff_s(a, 0.5) for a in (1, 2, 3)] == [0.5, 1.0, 2.0]
    assert notify.backoff_s(30, 1.0) == 60.0
    assert all(notify.retryable(s) for s in (None, 408, 429, 500, 503))
    assert not any(notify.retryable(s) for s in (400, 401, 404))


class Poster:
    def __init__(self, answers: list[int | None], hang: threading.Event | None = None) -> None:
        self.answers, self.hang, self.calls = answers, hang, []  # type: ignore[var-annotated]

    def __call__(self, url: str, data: bytes, headers: dict[str, str], timeout_s: float) -> int | None:
        self.calls.append((url, data, headers))
        if self.hang is not None:
            self.hang.wait(10)
        return self.answers.pop(0) if self.answers else 200


def test_sender_retries_transient_failures_and_counts_each_delivery() -> None:
    counts: list[str] = []
    poster = Poster([503, None, 200, 404])
    sender = WebhookNotifier(["http://a/hook", "http://b/hook"], "json", b"k", retries=3, backoff_s=0.01,
                             count=counts.append, poster=poster)
    sender.send(notice())
    sender.close(timeout_s=5)
    assert counts == ["sent", "failed"], "a: 503, no answer, 200; b: 404 is final"
    assert [c[0] for c in poster.calls] == ["http://a/hook"] * 3 + ["http://b/hook"]
    _, data, headers = poster.calls[0]
    assert headers["X-Rtrl-Signature"] == notify.signature(b"k", data)


def test_sender_gives_up_after_the_retries() -> None:
    counts: list[str] = []
    poster = Poster([500] * 10)
    sender = WebhookNotifier(["http://a/hook"], retries=2, backoff_s=0.01, count=counts.append, poster=poster)
    sender.send(notice())
    sender.close(timeout_s=5)
    assert counts == ["failed"] and len(poster.calls) == 3


def test_a_hanging_receiver_never_blocks_send_and_overflow_is_dropped() -> None:
    counts: list[str] = []
    hang = threading.Event()
    sender = WebhookNotifier(["http://a/hook"], queue_size=2, count=counts.append, poster=Poster([], hang))
    started = time.monotonic()
    for _ in range(6):  # one in flight, two queued, the rest dropped
        sender.send(notice())
        time.sleep(0.05)
    assert time.monotonic() - started < 1.0
    assert counts.count("dropped") == 3
    hang.set()
    sender.close(timeout_s=5)
    assert counts.count("sent") == 3


def test_settings_take_urls_as_secrets_and_refuse_other_schemes() -> None:
    s = NotifySettings(urls=("https://hooks.example/T0/B0/xyz",), format="slack")  # type: ignore[arg-type]
    assert "xyz" not in repr(s)
    with pytest.raises(ValidationError, match="http:// or https://"):
        NotifySettings(urls=("file:///etc/passwd",))  # type: ignore[arg-type]


def test_a_canary_that_starts_waiting_for_approval_is_announced_once() -> None:
    waiting = replace(RUNNING, phase=Phase.AWAITING_APPROVAL)
    n = notify.notice_of(RUNNING, waiting, T, "rtrl-policy")
    assert n is not None and n.outcome == "awaiting_approval" and n.candidate == "7"
    assert notify.notice_of(waiting, replace(waiting, step=3), T) is None, "still waiting: quiet"
    doc = json.loads(notify.body(n, "json"))
    assert doc["decision"] == "wait" and "rtrl approve 7" in doc["summary"]
    assert notify.body(n, "slack").decode().startswith('{"text":":hourglass: *rtrl rtrl-policy v7 passed')
