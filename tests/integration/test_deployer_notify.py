"""Decision notifications from the real controller (Redis, MLflow server) to a webhook
receiver on loopback: signed bodies, retries against a failing receiver, and a receiver
that hangs while the controller keeps deciding."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from deployer_helpers import deployer_settings, operator_command, register_versions, with_operators
from prometheus_client import REGISTRY

from deployer import notify
from deployer.adapters.webhook import WebhookNotifier
from deployer.controller import Controller
from deployer.status import Phase
from services.settings.model import Settings
from services.settings.notify import NotifySettings
from services.wiring.deployer import build_controller, build_ports

SECRET = "hmac-test-key"


HANG_S = 300.0
"""How long a hanging receiver holds a notice (the test releases it sooner): far above what a
tick takes even on a loaded machine, whose MLflow calls took 20-30 s a tick in one CI run
(2-3 s idle), so a tick that waited for the receiver cannot pass for a slow one."""


class Receiver:
    """An HTTP server on loopback that records every POST and answers ``status`` (after
    waiting for ``release`` when ``hang`` is set)."""

    def __init__(self) -> None:
        self.requests: list[tuple[dict[str, str], bytes]] = []
        self.status = 200
        self.hang = False
        self.release = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                data = self.rfile.read(int(self.headers["Content-Length"]))
                outer.requests.append((dict(self.headers), data))
                if outer.hang:
                    outer.release.wait(HANG_S)
                self.send_response(outer.status)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/rtrl"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


@dataclass(frozen=True)
class Operated:
    """A controller and the token files of the operators it accepts."""

    controller: Controller
    tokens: dict[str, Path]


def controller_for(settings: Settings, mlflow_server: str, tmp: Path, url: str, **notify_kw: object
                   ) -> Operated:
    """Versions 1..3 (gate pass), champion 1, no candidate (the controller stays idle until an
    operator decides), and a controller notifying ``url``."""
    deploy, tokens = with_operators(deployer_settings(settings, mlflow_server), tmp, "alice")
    deploy = deploy.model_copy(update={"notify": NotifySettings(
        urls=(url,), secret=SECRET, **{"retries": 0, "backoff_s": 0.05, **notify_kw})})  # type: ignore[arg-type]
    reg = register_versions(deploy, tmp, n=3)
    reg.delete_alias("candidate")
    return Operated(build_controller(deploy, build_ports(deploy), None), tokens)


def decide(operated: Operated, kind: str, version: str) -> float:
    """Queue an operator command, run one tick; the tick's wall time."""
    controller = operated.controller
    controller.ports.state.push(operator_command(operated.tokens, "alice", kind, version))
    started = time.monotonic()
    status = controller.step()
    took = time.monotonic() - started
    assert status is not None and status.phase in (Phase.SUCCEEDED, Phase.ROLLED_BACK), status
    return took


def sample(result: str) -> float:
    return REGISTRY.get_sample_value("rtrl_notifications_total", {"result": result}) or 0.0


def wait_for(predicate: object, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_decision_reaches_the_receiver_signed(settings: Settings, mlflow_server: str, tmp_path: Path,
                                                receiver: Receiver) -> None:
    sent = sample("sent")
    op = controller_for(settings, mlflow_server, tmp_path, receiver.url)
    decide(op, "promote", "2")
    wait_for(lambda: sample("sent") == sent + 1)
    (headers, data), = receiver.requests
    assert notify.verify(SECRET.encode(), data, headers[notify.SIGNATURE_HEADER])
    doc = json.loads(data)
    assert doc["event"] == "rtrl.canary.decision" and doc["outcome"] == "promoted"
    assert doc["candidate"] == "2" and doc["stable"] == "1" and doc["decided_by"] == "alice"
    assert doc["model"] == op.controller.config.model_name
    assert doc["reason"] == "promoted by hand by alice"
    assert doc["links"]["v2 in MLflow"] == f"{mlflow_server}/#/models/{doc['model']}/versions/2"


def test_a_failing_receiver_gets_retries_and_the_failure_is_counted(
        settings: Settings, mlflow_server: str, tmp_path: Path, receiver: Receiver) -> None:
    receiver.status = 503
    failed = sample("failed")
    op = controller_for(settings, mlflow_server, tmp_path, receiver.url, retries=2, format="slack")
    decide(op, "promote", "2")
    wait_for(lambda: sample("failed") == failed + 1)
    assert len(receiver.requests) == 3, "one attempt and two retries"
    assert {d for _, d in receiver.requests} == {receiver.requests[0][1]}, "each retry sends the same body"
    assert "promoted v2 to champion" in json.loads(receiver.requests[0][1])["text"]


def test_the_controller_keeps_deciding_while_the_receiver_hangs(
        settings: Settings, mlflow_server: str, tmp_path: Path, receiver: Receiver) -> None:
    receiver.hang = True
    dropped = sample("dropped")
    op = controller_for(settings, mlflow_server, tmp_path, receiver.url, timeout_s=HANG_S,
                                queue_size=1)
    ticks = [decide(op, "promote", "2")]
    wait_for(lambda: len(receiver.requests) == 1)  # the sender now hangs on the first notice
    ticks += [decide(op, "promote", "3"), decide(op, "rollback", "1")]
    assert op.controller.ports.registry.alias_version("champion") == "1", "all three decisions were made"
    # a tick that waited for the receiver would take its whole hang (HANG_S)
    assert max(ticks) < HANG_S / 3, f"a tick waited for the receiver: {ticks}"
    assert sample("dropped") == dropped + 1, "queue of 1: the third notice was dropped"
    receiver.release.set()
    assert isinstance(op.controller.ports.notifier, WebhookNotifier)
    op.controller.ports.notifier.close(timeout_s=10)
    assert len(receiver.requests) == 2
