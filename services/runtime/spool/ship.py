"""The shipper of a spool (services/runtime/spool/store.py): reads every segment, sends its records,
flushes, and moves a segment's offset on only when every record sent was acknowledged.

A record is converted to the events the sender takes by ``convert`` (one or more; ValueError:
it can never be sent, counted ``invalid`` and skipped); one spooled longer ago than ``max_age_s`` is
``dropped`` instead of sent. A failed send or acknowledgement leaves the offset where it was:
the batch is sent again after ``retry_s`` (``failed`` counts attempts, not losses), so a broker
outage costs disk, not events, until the spool is full.

Outcomes go to ``count(result, n)`` once per batch that completed, so a batch sent twice is
counted once; the depth and the age of the oldest waiting record go to ``gauge(bytes, age_s)``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from services.runtime.spool import store as spool

log = logging.getLogger(__name__)


class Sender(Protocol):
    def send(self, event: Any) -> Any: ...

    def flush(self, timeout: float | None = None) -> None: ...

    def close(self, timeout: float | None = None) -> None: ...


@dataclass(frozen=True)
class Limits:
    max_bytes: int = 1 << 30
    """Writers refuse records while this much waits unshipped."""
    max_age_s: float = 24 * 3600.0
    """Records spooled longer ago are dropped, not sent."""
    batch_bytes: int = 1 << 20
    """Read and sent per round trip (then one flush)."""
    ack_timeout_s: float = 30.0
    retry_s: float = 2.0
    poll_s: float = 0.2
    """Wait after a pass that found nothing new: each batch costs a flush and an offset write,
    so waiting gathers more records per batch (a delivery is due within a reward window, not
    a request)."""


class _BatchFailedError(Exception):
    pass


class SpoolShipper:
    def __init__(self, directory: Path, make_sender: Callable[[], Sender],
                 convert: Callable[[dict[str, Any]], list[Any]], count: Callable[[str, int], None],
                 limits: Limits | None = None,
                 gauge: Callable[[int, float], None] | None = None) -> None:
        self.directory = directory
        self._make_sender = make_sender
        self._convert = convert
        self._count = count
        self.limits = limits or Limits()
        self._gauge = gauge or (lambda _b, _a: None)
        self._sender: Sender | None = None
        self._ok = False
        self._status_at = 0.0
        self._status = spool.Status()

    # ----------------------------------------------------------------- one pass
    def ship_once(self) -> tuple[int, int]:
        """Ship what is there now: (records handled, bytes still waiting)."""
        handled, depth, oldest = 0, 0, 0.0
        for seg in spool.segments(self.directory):
            gone = spool.writer_gone(seg)  # before the size: a gone writer's size is final
            size, off = seg.stat().st_size, spool.offset_of(seg)
            if off < size and self._connected():
                n, off, first_at = self._ship_segment(seg, off, size)
                handled += n
                if first_at:
                    oldest = min(oldest or first_at, first_at)
            if gone and size - off < self.limits.batch_bytes and _tail_only(seg, off, size):
                if off < size:
                    self._count("invalid", 1)  # a line its writer did not finish (killed mid-write)
                    log.warning("%s: dropped a torn last record (%d bytes)", seg.name, size - off)
                spool.remove(seg)
                continue
            depth += size - off
        self._report(depth, oldest)
        return handled, depth

    def _connected(self) -> bool:
        if self._sender is None:
            try:
                self._sender = self._make_sender()
                log.info("spool %s: connected", self.directory)
            except Exception as exc:
                self._ok = False
                log.warning("spool %s: cannot connect (retry in %.0fs): %s",
                            self.directory, self.limits.retry_s, exc)
                return False
        return True

    def _ship_segment(self, seg: Path, off: int, size: int) -> tuple[int, int, float]:
        """Ship ``seg`` from ``off`` up to ``size``: (records, new offset, spool time of the first
        record still waiting (0: none))."""
        handled = 0
        with seg.open("rb") as f:
            while off < size:
                lines, used = _read_lines(f, off, size, self.limits.batch_bytes)
                if not lines:
                    return handled, off, 0.0
                try:
                    self._deliver(lines)
                except _BatchFailedError:
                    return handled, off, _first_at(lines)
                off += used
                handled += len(lines)
                spool.set_offset(seg, off)
        return handled, off, 0.0

    def _deliver(self, lines: list[bytes]) -> None:
        assert self._sender is not None
        outcome = {"sent": 0, "dropped": 0, "invalid": 0}
        futures = []
        now = time.time()
        for line in lines:
            try:
                at, record = spool.decode(line)
                if now - at > self.limits.max_age_s:
                    outcome["dropped"] += 1
                    continue
                events = self._convert(record)
            except ValueError as exc:
                outcome["invalid"] += 1
                log.error("spooled record cannot be sent, skipped: %s", exc)
                continue
            futures += [self._send(event, outcome) for event in events]
        try:
            self._sender.flush(self.limits.ack_timeout_s)
            for future in futures:
                if future is not None:
                    future.get(timeout=self.limits.ack_timeout_s)
        except Exception as exc:
            self._failed(len(futures), exc)
        self._ok = True
        for result, n in outcome.items():
            if n:
                self._count(result, n)

    def _send(self, event: Any, outcome: dict[str, int]) -> Any:
        assert self._sender is not None
        try:
            future = self._sender.send(event)
        except ValueError as exc:  # the event itself (e.g. too large): it never will be sent
            outcome["invalid"] += 1
            log.error("spooled record not sent: %s", exc)
            return None
        except Exception as exc:  # the broker (metadata timeout...): the batch is retried
            self._failed(1, exc)
        outcome["sent"] += 1
        return future

    def _failed(self, n: int, exc: BaseException) -> None:
        self._ok = False
        self._count("failed", max(n, 1))
        log.warning("spool %s: delivery failed, retrying in %.0fs: %s",
                    self.directory, self.limits.retry_s, exc)
        raise _BatchFailedError() from exc

    def _report(self, depth: int, oldest: float) -> None:
        self._gauge(depth, time.time() - oldest if oldest else 0.0)
        now = time.time()
        status = spool.Status(bytes=depth, full=depth >= self.limits.max_bytes,
                              healthy=self._sender is not None and self._ok, at=now)
        changed = (status.full, status.healthy) != (self._status.full, self._status.healthy)
        if changed or now - self._status_at >= 1.0:
            spool.write_status(self.directory, status)
            self._status, self._status_at = status, now

    # ----------------------------------------------------------------- loop
    def run(self, stop: threading.Event, drain_s: float = 10.0) -> None:
        """Ship until ``stop`` is set, then for up to ``drain_s`` while something is left and
        deliveries succeed; close the sender."""
        with spool.exclusive(self.directory):
            while not stop.is_set():
                handled, _ = self.ship_once()
                if not self._ok:
                    stop.wait(self.limits.retry_s)
                elif not handled:
                    stop.wait(self.limits.poll_s)
            deadline = time.monotonic() + drain_s
            depth = 1
            while depth and time.monotonic() < deadline:
                _, depth = self.ship_once()
                if depth and not self._ok:
                    time.sleep(min(self.limits.retry_s, max(0.0, deadline - time.monotonic())))
            if depth:
                log.warning("spool %s: %d bytes not shipped at stop; shipped at the next start",
                            self.directory, depth)
            if self._sender is not None:
                try:
                    self._sender.close(2.0)
                except Exception as exc:
                    log.warning("closing the spool's sender failed: %s", exc)


def _first_at(lines: list[bytes]) -> float:
    try:
        return spool.decode(lines[0])[0]
    except ValueError:
        return 0.0


def _read_lines(f: Any, off: int, size: int, batch: int) -> tuple[list[bytes], int]:
    """The complete lines in about ``batch`` bytes from ``off`` (more when one line is longer)."""
    f.seek(off)
    lines, used = spool.complete_lines(f.read(min(batch, size - off)))
    if not lines and size - off > batch:
        f.seek(off)
        data = f.read(size - off)
        end = data.find(b"\n")
        return ([data[:end]], end + 1) if end >= 0 else ([], 0)
    return lines, used


def _tail_only(seg: Path, off: int, size: int) -> bool:
    """Nothing complete left after ``off``: at most one unterminated line."""
    if off >= size:
        return True
    with seg.open("rb") as f:
        f.seek(off)
        return b"\n" not in f.read(size - off)
