"""A process that started the gateway's exposure child and exits without stopping it still
exits: the child ignores SIGTERM, so multiprocessing's own exit handler (SIGTERM, then wait)
would wait for it forever."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def test_an_owner_that_never_calls_stop_still_exits() -> None:
    with socket.socket() as s:  # a port nobody listens on: the child keeps trying to connect
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = textwrap.dedent(f"""
        from services.gateway.exposure import ExposureProcess
        from services.settings.model import settings_from_env
        settings = settings_from_env({{"RTRL_KAFKA__BOOTSTRAP_SERVERS": "127.0.0.1:{port}"}})
        import time
        proc = ExposureProcess(settings).start()
        time.sleep(4)  # the child is up and ignores SIGTERM by now
        print("started", flush=True)
    """)
    started = time.monotonic()
    try:
        out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                             timeout=40)
    except subprocess.TimeoutExpired:
        pytest.fail("the process hung at exit waiting for its exposure child")
    assert "started" in out.stdout, out.stderr[-2000:]
    assert out.returncode == 0, out.stderr[-2000:]
    assert time.monotonic() - started < 30
