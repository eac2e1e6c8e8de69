"""Pieces the demo runs on: a process supervisor with clean shutdown, and a live tracker
of reward records per version and arm (for the progress line and the report).

The supervisor starts each service as its own process in its own session (so a service's
children, e.g. Ray workers, are stopped with it), logs to ``<log_dir>/<name>.log`` and
stops everything in reverse start order: SIGTERM to the service, a grace period, SIGKILL;
then whatever its process group still holds gets SIGTERM and, shortly after, SIGKILL.
Nothing is left running, whether the demo ends, fails or is interrupted.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kafka import TopicPartition

from ingest.adapters.idle_poll import IdlePoller
from services.report.cohorts import Cohort, Row, cohort, row_from_record
from services.runtime.kafka_io import make_consumer
from services.settings.model import Settings


@dataclass(frozen=True)
class ProcSpec:
    name: str
    argv: list[str]
    env: Mapping[str, str] = field(default_factory=dict)
    unset: tuple[str, ...] = ()
    """Variables of the demo's environment this process must not get (vLLM's own virtualenv
    must not see rtrl's PYTHONPATH)."""


def serve_argv(service: str) -> list[str]:
    """``rtrl serve <service>`` run with this interpreter (works without the entry point)."""
    return [sys.executable, "-m", "services.cli", "serve", service]


def module_available(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


class Supervisor:
    """Starts, watches and stops the demo's processes."""

    def __init__(self, log_dir: Path, base_env: Mapping[str, str] | None = None,
                 pid_file: Path | None = None) -> None:
        self.log_dir = log_dir
        self.base_env = dict(base_env or {})
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.reported_exit: set[str] = set()
        self.pid_file = pid_file
        """Where the process-group ids are recorded, so a later run can stop leftovers of a
        run that was killed without a chance to clean up (see :func:`stop_recorded`)."""

    def _record(self) -> None:
        if self.pid_file is not None:
            live = {n: p.pid for n, p in self.procs.items() if p.poll() is None}
            self.pid_file.write_text(json.dumps(live))

    def start(self, spec: ProcSpec) -> subprocess.Popen[bytes]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in {**os.environ, **self.base_env, **spec.env}.items() if k not in spec.unset}
        with open(self.log_dir / f"{spec.name}.log", "ab") as out:
            proc = subprocess.Popen(
                spec.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, env=env,
            )
        self.procs[spec.name] = proc
        self._record()
        return proc

    def run(self, spec: ProcSpec, timeout_s: float) -> int:
        """Run a one-shot command to completion (stopped like a service if interrupted)."""
        proc = self.start(spec)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop(spec.name)
            raise TimeoutError(f"{spec.name} did not finish in {timeout_s:.0f}s; see "
                               f"{self.log_dir / (spec.name + '.log')}") from None
        finally:
            self.procs.pop(spec.name, None)

    def exited(self) -> dict[str, int]:
        """Services that have exited since they were started (name -> return code)."""
        return {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}

    def newly_exited(self) -> dict[str, int]:
        out = {n: rc for n, rc in self.exited().items() if n not in self.reported_exit}
        self.reported_exit.update(out)
        return out

    def stop(self, name: str, grace_s: float = 20.0) -> int | None:
        proc = self.procs.get(name)
        if proc is None:
            return None
        return stop_group(proc, grace_s)

    def stop_all(self, grace_s: float = 20.0,
                 order: Sequence[str | Sequence[str]] | None = None) -> dict[str, int | None]:
        """SIGTERM every process group, stage by stage, and return the exit codes.

        ``order`` lists the stages: a name, or a tuple of names stopped at the same time
        (each with its own grace period); the next stage starts when the whole stage has
        stopped. Services not named, and every service without an ``order``, are stopped one
        by one in reverse start order afterwards."""
        stages = [[st] if isinstance(st, str) else list(st) for st in (order or ())]
        named = {n for stage in stages for n in stage}
        stages += [[n] for n in reversed(self.procs) if n not in named]
        codes: dict[str, int | None] = {}
        for stage in stages:
            with ThreadPoolExecutor(max_workers=len(stage)) as pool:
                for name, rc in zip(stage, pool.map(lambda n: self.stop(n, grace_s), stage), strict=True):
                    codes[name] = rc
        self._record()
        return codes

    def log_tail(self, name: str, lines: int = 15) -> str:
        path = self.log_dir / f"{name}.log"
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def stop_group(proc: subprocess.Popen[bytes], grace_s: float) -> int | None:
    """SIGTERM the process itself (so it can shut its own children down, e.g. Ray), wait up
    to ``grace_s``, then SIGKILL it; finally SIGTERM and then SIGKILL whatever is left in its
    process group."""
    if proc.poll() is None:
        try:
            proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    if _group_alive(proc.pid):
        _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + min(5.0, grace_s)
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        _signal_group(proc.pid, signal.SIGKILL)
    return proc.returncode


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def stop_recorded(pid_file: Path) -> list[str]:
    """SIGKILL the process groups a previous (killed) run recorded; return their names."""
    try:
        recorded = json.loads(pid_file.read_text())
    except (OSError, ValueError):
        return []
    stopped = []
    for name, pgid in recorded.items():
        try:
            os.killpg(int(pgid), signal.SIGKILL)
            stopped.append(str(name))
        except (ProcessLookupError, PermissionError, ValueError):
            continue
    pid_file.unlink(missing_ok=True)
    return stopped


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class RewardsTracker:
    """Consumes the rewards topic in a thread and keeps every record (for the report) and
    rows per (version, arm) (for the progress line)."""

    def __init__(self, settings: Settings, primary_horizon_s: int,
                 consumer_factory: Callable[[], Any] | None = None) -> None:
        self.settings = settings
        self.primary = primary_horizon_s
        self.records: list[dict[str, Any]] = []
        self.rows: deque[Row] = deque(maxlen=200_000)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._factory = consumer_factory
        self._thread = threading.Thread(target=self._run, name="rewards-tracker", daemon=True)
        self.error: str | None = None

    def start(self) -> RewardsTracker:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _consumer(self) -> Any:
        if self._factory:
            return self._factory()
        return make_consumer(self.settings.kafka, None)

    def _run(self) -> None:
        topic = self.settings.topics.rewards
        consumer = self._consumer()
        try:
            parts: set[int] = set()
            while not self._stop.is_set() and not parts:
                parts = consumer.partitions_for_topic(topic) or set()
                if not parts:
                    self._stop.wait(1.0)
            tps = [TopicPartition(topic, p) for p in sorted(parts)]
            if not tps:
                return
            consumer.assign(tps)
            consumer.seek_to_beginning(*tps)
            poller = IdlePoller(consumer, idle_ms=500, wait=self._stop.wait)
            while not self._stop.is_set():
                for recs in poller.poll(max_records=2000).values():
                    for rec in recs:
                        self.add_bytes(rec.value)
        except Exception as exc:  # the demo keeps going; the report reads the topic again
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            consumer.close()

    def add_bytes(self, value: bytes) -> None:
        try:
            rec = json.loads(value)
            row = row_from_record(rec, self.primary)
        except (TypeError, ValueError, KeyError, AttributeError, RecursionError):
            return
        with self._lock:
            self.records.append(rec)
            self.rows.append(row)

    def recent(self, window_s: float, now: float | None = None) -> dict[tuple[str, str], Cohort]:
        """Cohort metrics per (version, arm) over completions served in the last ``window_s``."""
        now = time.time() if now is None else now
        groups: dict[tuple[str, str], list[Row]] = {}
        with self._lock:
            for i, r in enumerate(reversed(self.rows)):
                if i >= 50_000:
                    break
                if r.served_ts >= now - window_s:
                    groups.setdefault((r.version, r.arm), []).append(r)
        return {k: cohort(v) for k, v in groups.items()}

    def count(self) -> int:
        with self._lock:
            return len(self.records)

    def snapshot(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.records)
