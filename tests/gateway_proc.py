"""``rtrl serve gateway`` as a child process in front of a stand-in engine, and clients that
keep asking it: what the gateway worker tests share (tests/integration/test_gateway_workers.py,
tests/reliability/test_gateway_worker_kill.py)."""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from ingest.events import CompletionServed, parse_event
from services.runtime.kafka_io import make_consumer
from services.settings.model import Settings
from services.stack.embedded import free_port
from tests.service_env import service_env

KEY = "workers-api-key"
MODEL = "workers-policy"


class Gateway:
    """The gateway as a process, started the way a user starts it."""

    def __init__(self, settings: Settings, tmp: Path, engine_url: str, workers: int, **extra: str) -> None:
        self.port = free_port()
        self.spool = tmp / "spool"
        env = service_env(settings, tmp / "nostack", **{
            "RTRL_MLFLOW__TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}",
            "RTRL_MLFLOW__REGISTERED_MODEL": MODEL,
            "RTRL_ENGINE__KIND": "vllm",
            "RTRL_ENGINE__BASE_URL": engine_url,
            "RTRL_ENGINE__BASE_MODEL": "base",
            "RTRL_GATEWAY__PORT": str(self.port),
            "RTRL_GATEWAY__WORKERS": str(workers),
            "RTRL_GATEWAY__SPOOL_DIR": str(self.spool),
            "RTRL_GATEWAY__ROUTING_POLL_S": "0.2",
            "RTRL_GATEWAY__SECRET": "workers-secret",
            "RTRL_GATEWAY__API_KEYS": json.dumps({"team": KEY}),
            **extra,
        })
        self.log = (tmp / "gateway.log").open("wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "gateway"], env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT)

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-4000:]

    def get(self, path: str) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def wait_ready(self, workers: int, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, self.output()
            try:
                if self.get("/readyz")[0] == 200 and len(self.worker_pids()) == workers:
                    return
            except OSError:
                pass
            assert time.monotonic() < deadline, "the gateway never became ready:\n" + self.output()
            time.sleep(0.3)

    def worker_pids(self) -> set[int]:
        """The pids of the workers writing the spool now (segments are named after them)."""
        return {int(p.name.split("-")[1]) for p in self.spool.glob("w*.seg")}

    def served_by(self) -> dict[str, int]:
        """request id -> pid of the worker that served it, from the live workers' spool segments
        (a segment keeps its lines until its worker is gone)."""
        out = {}
        for seg in self.spool.glob("w*.seg"):
            pid = int(seg.name.split("-")[1])
            for line in seg.read_bytes().splitlines():
                out[json.loads(line)["record"]["request_id"]] = pid
        return out

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return int(self.proc.returncode)


def ask(conn: http.client.HTTPConnection, rid: str, user: str, stream: bool) -> tuple[bool, str | None]:
    """One completion: (answered in full, the arm that served it)."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "user": user, "request_id": rid,
            "stream": stream}
    conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    arm = resp.getheader("X-Rtrl-Arm")
    if resp.status != 200:
        return False, arm
    if stream:
        return data.rstrip().endswith(b"data: [DONE]"), arm
    return json.loads(data)["rtrl"]["request_id"] == rid, arm


class Load:
    """Clients that keep asking, half of them streamed, each on its own connection."""

    def __init__(self, port: int, clients: int) -> None:
        self.port, self.answered, self.sent = port, set[str](), 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(clients)]

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)

    def _run(self, k: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        n = 0
        while not self._stop.is_set():
            rid = f"c{k}-{n}"
            n += 1
            with self._lock:
                self.sent += 1
            try:
                ok, _ = ask(conn, rid, f"user-{k}", stream=n % 2 == 0)
            except (OSError, http.client.HTTPException, ValueError):
                ok = False  # the worker holding this connection was killed: connect again
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
            if ok:
                with self._lock:
                    self.answered.add(rid)
        conn.close()


def served_events(settings: Settings, expected: int, timeout_s: float = 60.0) -> list[CompletionServed]:
    consumer = make_consumer(settings.kafka, None, [settings.topics.raw])
    found: list[CompletionServed] = []
    deadline = time.monotonic() + timeout_s
    quiet_until = None
    try:
        while time.monotonic() < deadline:
            got = [r for batch in consumer.poll(timeout_ms=300).values() for r in batch]
            for record in got:
                event = parse_event(record.value)
                assert isinstance(event, CompletionServed)
                found.append(event)
            if len(found) >= expected and not got:
                quiet_until = quiet_until or time.monotonic() + 3.0  # and nothing more comes
                if time.monotonic() > quiet_until:
                    break
    finally:
        consumer.close()
    return found
