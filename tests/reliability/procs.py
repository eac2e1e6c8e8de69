"""Real service processes for the reliability tests: ``rtrl serve ingest|reward|gateway``
started from ``RTRL_*`` environments, their HTTP endpoints, and topic readers."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kafka import TopicPartition

from services.runtime.kafka_io import make_consumer
from services.settings.model import Settings
from tests.service_env import service_env

RTRL = str(Path(sys.executable).parent / "rtrl")
_PORT_LINE = re.compile(r"http://127\.0\.0\.1:(\d+)")


def base_env(settings: Settings, tmp_path: Path, **extra: str) -> dict[str, str]:
    """The process environment for ``settings`` (and nothing from the caller's RTRL_*)."""
    return service_env(settings, tmp_path / "no-stack", **extra)


@dataclass
class Service:
    """One running ``rtrl serve <name>`` process; its output goes to ``log``."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    port: int = 0
    pid: int = field(init=False)

    def __post_init__(self) -> None:
        self.pid = self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def get(self, path: str) -> tuple[int, str]:
        return http_get(self.port, path)

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM and wait; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            self.proc.kill()
            self.proc.wait()
            why = f"{self.name} did not stop within {timeout}s on SIGTERM; see {self.log}"
            raise AssertionError(why) from exc

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def start(name: str, args: list[str], env: dict[str, str], tmp_path: Path,
          port: int | None = None, timeout_s: float = 90) -> Service:
    """Start ``rtrl serve <name> <args>`` and wait until its HTTP port answers /healthz.
    Without ``port``, the port is read from the first ``http://127.0.0.1:N`` in its log."""
    log = tmp_path / f"{name}-{time.monotonic_ns()}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([RTRL, "serve", name, *args], env=env, cwd=tmp_path,
                                stdout=out, stderr=subprocess.STDOUT)
    svc = Service(name, proc, log, port or 0)
    deadline = time.monotonic() + timeout_s
    while svc.port == 0:
        assert svc.alive(), f"{name} exited with {proc.returncode}:\n{svc.text()[-3000:]}"
        assert time.monotonic() < deadline, f"{name} printed no port:\n{svc.text()[-3000:]}"
        found = _PORT_LINE.search(svc.text())
        if found:
            svc.port = int(found.group(1))
        time.sleep(0.05)
    while True:
        try:
            if svc.get("/healthz")[0] in (200, 503):
                return svc
        except OSError:
            pass
        assert svc.alive(), f"{name} exited with {proc.returncode}:\n{svc.text()[-3000:]}"
        assert time.monotonic() < deadline, f"{name} never answered /healthz:\n{svc.text()[-3000:]}"
        time.sleep(0.1)


def http_get(port: int, path: str, timeout: float = 5) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def wait_until(check: Any, timeout_s: float, what: str, services: list[Service] = (),  # type: ignore[assignment]
               every: float = 0.2) -> None:
    """Poll ``check()`` until true; fail early when any of ``services`` died."""
    deadline = time.monotonic() + timeout_s
    while not check():
        for svc in services:
            assert svc.alive(), f"{svc.name} died ({svc.proc.returncode}):\n{svc.text()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every)


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in a Prometheus text exposition (0.0 when absent)."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        got = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', head))
        if head.split("{")[0] == name and all(got.get(k) == v for k, v in labels.items()):
            return float(value)
    return 0.0


class TopicReader:
    """Reads every committed record of a topic from the beginning, incrementally."""

    def __init__(self, settings: Settings, topic: str) -> None:
        self.consumer = make_consumer(settings.kafka, None, fetch_max_bytes=8 * 1024 * 1024,
                                      max_partition_fetch_bytes=4 * 1024 * 1024)
        parts = self.consumer.partitions_for_topic(topic) or set()
        deadline = time.monotonic() + 20
        while not parts and time.monotonic() < deadline:
            time.sleep(0.1)
            parts = self.consumer.partitions_for_topic(topic) or set()
        self.consumer.assign([TopicPartition(topic, p) for p in sorted(parts)])
        self.consumer.seek_to_beginning()
        self.records: list[Any] = []

    def poll(self) -> int:
        for recs in self.consumer.poll(timeout_ms=200, max_records=5000).values():
            self.records.extend(recs)
        return len(self.records)

    def read(self, expect: int, timeout_s: float, settle_s: float = 1.0,
             services: list[Service] = ()) -> list[Any]:  # type: ignore[assignment]
        """Poll until ``expect`` records, then ``settle_s`` more (to see extra ones)."""
        wait_until(lambda: self.poll() >= expect, timeout_s, f"{expect} records", services, every=0)
        settle = time.monotonic() + settle_s
        while time.monotonic() < settle:
            self.poll()
        return self.records

    def close(self) -> None:
        self.consumer.close()
