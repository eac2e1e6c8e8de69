"""Exposure logging: one signed ``completion.served`` event per request, never on the
response path.

The request thread only puts the served fields on a bounded in-memory queue
(``log`` never blocks). A background thread builds the event (contract validation),
signs it and hands it to the Kafka producer, which batches. So:

* a slow or unreachable broker adds no latency to responses;
* while the broker is unreachable the queue fills; beyond ``maxsize`` events are dropped
  and counted (``rtrl_gateway_exposures_total{result="dropped"}``), the gateway keeps
  serving, and ``/readyz`` lists ``broker`` as degraded (advisory: still ready) so on-call sees it;
* a producer that cannot be created at start (broker down) is retried every ``retry_s``;
* ``stop`` drains the queue and flushes the producer (SIGTERM loses nothing that reached
  the queue, as long as the broker answers within the flush timeout).

Delivery results come back through the producer's futures: ``sent`` on ack, ``failed``
when the broker refused or the send timed out.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from ingest.contracts.prometheus import DEPENDENCY_RETRIES, GATEWAY_EXPOSURES
from ingest.events import EVENT_ADAPTER, CompletionServed
from services.runtime.event_producer import EventProducer, EventTooLargeError
from services.runtime.kafka_io import make_producer
from services.runtime.process import setup_logging
from services.runtime.spool.store import SpoolWriter
from services.settings.services import GatewaySettings

log = logging.getLogger(__name__)

ALSO = "also"
"""A logged record's key for the events that go out with its ``completion.served`` (a list
of event fields, each with its ``type``)."""


class _Sender(Protocol):
    """What the logger needs of services.runtime.event_producer.EventProducer."""

    def send(self, event: Any) -> Any: ...

    def flush(self, timeout: float | None = None) -> None: ...

    def close(self, timeout: float | None = None) -> None: ...


def count_exposures(result: str, n: int) -> None:
    GATEWAY_EXPOSURES.labels(result).inc(n)
    if result == "failed":  # the broker did not take it: a failed call to a dependency
        DEPENDENCY_RETRIES.labels("gateway", "kafka").inc(n)


class ExposureLogger:
    def __init__(
        self,
        make_sender: Callable[[], _Sender],
        maxsize: int = 10_000,
        retry_s: float = 2.0,
        count: Callable[[str, int], None] | None = None,
    ) -> None:
        self._make_sender = make_sender
        self._count = count or count_exposures
        """Called with (result, n) for every outcome; the metric by default."""
        self._queue: queue.Queue[dict[str, Any]] = queue.Queue(maxsize=maxsize)
        self._retry_s = retry_s
        self._sender: _Sender | None = None
        self._healthy = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="exposures", daemon=True)

    # ----------------------------------------------------------------- request path
    def log(self, fields: dict[str, Any]) -> bool:
        """Queue one served event's fields (CompletionServed keyword arguments); never blocks.
        Returns False when the queue is full and the event was dropped."""
        try:
            self._queue.put_nowait(fields)
            return True
        except queue.Full:
            self._count("dropped", 1)
            return False

    @property
    def healthy(self) -> bool:
        """The producer exists, its last delivery succeeded and the queue is not full."""
        return self._sender is not None and self._healthy and not self._queue.full()

    @property
    def pending(self) -> int:
        return self._queue.qsize()

    # ----------------------------------------------------------------- background
    def start(self) -> ExposureLogger:
        self._thread.start()
        return self

    def _connect(self) -> bool:
        try:
            self._sender = self._make_sender()
            self._healthy = True
            log.info("exposure logging connected to the broker")
            return True
        except Exception as exc:
            log.warning("broker unreachable for exposure logging (retry in %.0fs): %s", self._retry_s, exc)
            return False

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sender is None and not self._connect():
                self._stop.wait(self._retry_s)
                continue
            try:
                fields = self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
            self._send(fields)

    def _send(self, fields: dict[str, Any]) -> None:
        try:
            events = exposure_events(fields, self._count)
        except ValueError as exc:
            self._count("invalid", 1)
            log.error("served event does not fit the contract, not sent: %s", exc)
            return
        for event in events:
            self._send_one(event)

    def _send_one(self, event: Any) -> None:
        assert self._sender is not None
        try:
            future = self._sender.send(event)
        except EventTooLargeError as exc:  # the event, not the broker: stays healthy
            self._count("invalid", 1)
            log.error("%s event not sent: %s", event.type, exc)
            return
        except Exception as exc:  # e.g. metadata timeout while the broker is down
            self._healthy = False
            self._count("failed", 1)
            log.warning("could not hand a %s event to the producer: %s", event.type, exc)
            return
        if future is not None and hasattr(future, "add_callback"):
            future.add_callback(self._on_sent)
            future.add_errback(self._on_failed)
        else:
            self._on_sent(None)

    def _on_sent(self, _meta: object) -> None:
        self._healthy = True
        self._count("sent", 1)

    def _on_failed(self, exc: BaseException) -> None:
        self._healthy = False
        self._count("failed", 1)
        log.warning("served event not delivered: %s", exc)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Drain the queue into the producer, flush and close it."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)
        deadline = time.monotonic() + timeout_s
        if self._sender is not None:  # never connected: no point waiting for a bootstrap now
            while time.monotonic() < deadline:
                try:
                    self._send(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                self._sender.flush(max(0.1, deadline - time.monotonic()))
                self._sender.close(1.0)
            except Exception as exc:
                log.warning("flushing served events at stop failed: %s", exc)
        left = self._queue.qsize()
        if left:
            self._count("dropped", left)
            log.warning("%d served events dropped at stop (broker unreachable)", left)


# --------------------------------------------------------------------- in a child process

RESULTS = ("sent", "failed", "dropped", "invalid")


class ExposureProcess:
    """The same logger run in a child process, so the Kafka client's CPU work (about
    0.5-1.3 ms per event in kafka-python) never holds the gateway's GIL.

    The request thread pickles the fields onto a multiprocessing queue (tens of
    microseconds, done by the queue's feeder thread). The child runs an
    :class:`ExposureLogger` and reports its outcome counts and health through shared
    memory; a parent thread turns them into the ``rtrl_gateway_exposures_total`` metric.
    The child ignores SIGINT/SIGTERM (the parent stops it with a sentinel after draining)
    and exits by itself if the parent dies.
    """

    def __init__(self, settings: Any, maxsize: int = 10_000) -> None:
        ctx = mp.get_context("spawn")  # never fork a process that runs torch and threads
        self._queue: Any = ctx.Queue(maxsize=maxsize)
        self._counts: Any = ctx.Array("q", len(RESULTS))
        self._healthy: Any = ctx.Value("b", 0)
        self._proc = ctx.Process(
            target=_child_main, args=(settings, maxsize, self._queue, self._counts, self._healthy),
            name="rtrl-exposures", daemon=True,
        )
        self._seen = [0] * len(RESULTS)
        self._stop = threading.Event()
        self._sync_thread = threading.Thread(target=self._sync_loop, name="exposure-sync", daemon=True)

    def start(self) -> ExposureProcess:
        self._proc.start()
        self._sync_thread.start()
        atexit.register(self._at_exit)
        return self

    def _at_exit(self) -> None:
        """The interpreter exits while the child still runs (its owner never called
        :meth:`stop`): stop it now. multiprocessing's own exit handler would send it SIGTERM,
        which the child ignores, and then wait for it forever."""
        if self._proc.is_alive():
            self.stop(timeout_s=2.0)

    def log(self, fields: dict[str, Any]) -> bool:
        try:
            self._queue.put_nowait(fields)
            return True
        except queue.Full:
            GATEWAY_EXPOSURES.labels("dropped").inc()
            return False

    @property
    def healthy(self) -> bool:
        return bool(self._healthy.value) and self._proc.is_alive()

    def _sync(self) -> None:
        for i, result in enumerate(RESULTS):
            now = int(self._counts[i])
            if now > self._seen[i]:
                count_exposures(result, now - self._seen[i])
                self._seen[i] = now

    def _sync_loop(self) -> None:
        while not self._stop.wait(0.5):
            self._sync()
            if not self._proc.is_alive():
                log.error("exposure process exited (code %s); served events are dropped",
                          self._proc.exitcode)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Let the child drain, flush and exit; then account for its last counts. A child
        that does not exit in time is killed (it ignores SIGTERM) and what it still held is
        lost, as the warning says."""
        atexit.unregister(self._at_exit)
        self._stop.set()
        if self._proc.is_alive():
            try:
                self._queue.put(None, timeout=timeout_s)
            except queue.Full:
                pass
            self._proc.join(timeout_s + 2.0)
            if self._proc.is_alive():
                log.warning("exposure process did not stop in time; killing it "
                            "(the served events it still held are lost)")
                self._proc.kill()
                self._proc.join(2.0)
                self._queue.cancel_join_thread()  # nobody reads the pipe any more
        self._sync()
        self._queue.close()
        self._queue.join_thread()


def _child_main(settings: Any, maxsize: int, q: Any, counts: Any, healthy: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    setup_logging(settings.log_level, "gateway-exposures")
    parent = os.getppid()
    index = {r: i for i, r in enumerate(RESULTS)}

    def count(result: str, n: int) -> None:
        with counts.get_lock():
            counts[index[result]] += n

    logger = ExposureLogger(lambda: make_event_producer(settings), maxsize, count=count).start()
    while True:
        healthy.value = int(logger.healthy)
        try:
            item = q.get(timeout=0.5)
        except queue.Empty:
            if os.getppid() != parent:  # orphaned: the gateway died without stopping us
                break
            continue
        if item is None:
            break
        logger.log(item)
    logger.stop()
    healthy.value = 0


def make_event_producer(settings: Any) -> Any:
    """The signed producer of served events (fails fast while the broker is unreachable)."""
    gw: GatewaySettings = settings.gateway
    secret = gw.secret
    if gw.key_id is not None and secret is None:
        secret = settings.auth.keys.get(gw.key_id)
        if secret is None:
            raise RuntimeError(
                f"no signing secret for key id {gw.key_id!r}: set RTRL_GATEWAY__SECRET or "
                f"RTRL_AUTH__KEYS, or RTRL_GATEWAY__KEY_ID=null to send unsigned (development)"
            )
    # bounded waits: a down broker costs the background thread seconds, never the requests
    producer = make_producer(settings.kafka, max_block_ms=5000, bootstrap_timeout_ms=5000,
                             linger_ms=gw.exposure_linger_ms)
    return EventProducer(settings, gw.key_id, secret, producer=producer)


# --------------------------------------------------------------------- spooled (workers)


class SpooledExposures:
    """A gateway worker's exposure log: each served event's fields are appended to the
    worker's spool segment (services/runtime/spool/store.py) before its answer is sent; the
    gateway's shipper process delivers them (services/wiring/gateway_workers.py). A worker
    killed at any moment has lost nothing it answered; a broker outage fills the disk spool,
    up to ``spool_max_bytes``, instead of dropping events."""

    def __init__(self, directory: Path, name: str) -> None:
        self._writer = SpoolWriter(directory, name)

    def start(self) -> SpooledExposures:
        self._writer.open()
        return self

    def log(self, fields: dict[str, Any]) -> bool:
        if self._writer.append(fields):
            return True
        GATEWAY_EXPOSURES.labels("dropped").inc()
        return False

    @property
    def healthy(self) -> bool:
        """The shipper runs and its last delivery was acknowledged."""
        return self._writer.healthy

    def stop(self, timeout_s: float = 0.0) -> None:
        self._writer.close()


def exposure_events(record: dict[str, Any],
                    count: Callable[[str, int], None] = count_exposures) -> list[Any]:
    """A logged record as its events: those logged with it under :data:`ALSO` (a session
    turn's, services/gateway/chat/turns.py), then its ``completion.served``. All are keyed by
    the request, so they land on one partition in this order: the reward worker has read the
    turn's ``session.turn`` when it reads the served event, and a session turn's window can
    never close into a per-request reward first (a batch boundary or a restarted worker
    between the two would let it). ValueError when the served event does not fit the
    contract (then nothing goes); an accompanying event that does not is logged, counted
    ``invalid`` and left out, and the others still go."""
    fields = dict(record)
    also = fields.pop(ALSO, None) or []
    served = CompletionServed(**fields)
    events: list[Any] = []
    for extra in also if isinstance(also, list) else [also]:
        try:
            events.append(EVENT_ADAPTER.validate_python(extra))
        except ValueError as exc:
            count("invalid", 1)
            log.error("an event logged with request %s does not fit the contract, not sent: %s",
                      fields.get("request_id"), exc)
    return [*events, served]
