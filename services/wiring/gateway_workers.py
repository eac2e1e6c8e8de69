"""``rtrl serve gateway`` on every core: worker processes on one listening socket, one
shipper of served events, and the parent that keeps them running.

* **One socket.** The parent binds the port and hands the socket to each worker (spawned,
  never forked); the kernel gives each new connection to whichever worker accepts first, so
  a busy worker takes fewer. A worker that dies leaves the connections it had not accepted
  yet to the others, and the parent starts another one in its place.
* **Exposures, exactly once.** A worker appends each served event to its own spool segment
  (services/gateway/exposure.py ``SpooledExposures``) before the answer leaves, one
  ``write(2)``: a SIGKILLed worker has lost nothing it answered. The shipper process reads
  every worker's segments and delivers them to the broker, moving its offsets only after the
  broker acknowledged (services/runtime/spool/ship.py); after a crash it sends a batch again,
  and ingest drops the repeats by ``event_id``.
* **Routing** is a pure function of the user and the routing table every worker reads from
  Redis, so a user gets the same arm from any worker; request ids are claimed in Redis, so a
  retry is recognised whichever worker takes it.
* **/metrics** is prometheus-client's multiprocess mode: the parent points
  ``PROMETHEUS_MULTIPROC_DIR`` at a fresh directory before it starts anyone, and any worker's
  ``/metrics`` reports every worker's and the shipper's values combined
  (``ingest.contracts.prometheus.multiprocess_registry``).
* **Stopping.** SIGTERM (or SIGINT) to the parent: the workers stop accepting and drain, then
  the shipper delivers what is left and exits. A worker or shipper whose parent died stops
  by itself.
"""

from __future__ import annotations

import gc
import logging
import math
import multiprocessing as mp
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from prometheus_client import multiprocess

from ingest.contracts.prometheus import (
    BUILD_INFO,
    GATEWAY_SPOOL_AGE,
    GATEWAY_SPOOL_BYTES,
    GATEWAY_WORKER_RESTARTS,
    multiprocess_registry,
)
from services.gateway.asgi.app import GatewayServer, listen_socket
from services.gateway.exposure import SpooledExposures, count_exposures, exposure_events, make_event_producer
from services.runtime.health import Health
from services.runtime.process import Stopper, name_process, setup_logging
from services.runtime.spool.ship import Limits, SpoolShipper
from services.runtime.spool.store import SpoolBusyError, SpoolDirError, private_dir
from services.wiring.gateway import build, registry

log = logging.getLogger("services.gateway")

SHIPPER_NAME = "rtrl-gw-shipper"
"""The shipper's process name (``ps``); workers are ``rtrl-gw-<index>``."""
SHIPPER_NICE = 5
"""The shipper's scheduling priority below the workers' (``nice``): its work can wait."""
QUICK_EXIT_S = 10.0
"""A worker that exits this soon after it started, three times in a row, stops the gateway:
restarting it again would only hide a configuration error."""
READY_WAIT_S = 30.0
"""A worker accepts connections once it can serve (its stable model loaded), waiting at most
this long: until then the kernel gives new connections to the workers that can, so a worker
that starts or replaces another never answers a user ``503 model_not_loaded`` while a sibling
could have served them. After the wait it accepts anyway, so ``/readyz`` says what is missing."""


AUTO_MAX_WORKERS = 8
"""``workers=0`` never starts more than this: without a CPU limit a pod "has" every core of
its node, and each worker holds its own memory."""
WORKER_BYTES = 320 << 20
SHARED_BYTES = 256 << 20
"""What ``workers=0`` budgets per worker (a worker in front of an engine holds about 72 MiB,
250 MiB once it reads the champion alias from MLflow)
and for the parent and the shipper together (about 70 MiB each), against the cgroup's memory
limit (docs/gateway.md, "Workers")."""


def worker_count(settings: Any) -> int:
    """``gateway.workers``, or for 0 the cores this process may use, as many as its memory
    limit holds, at most :data:`AUTO_MAX_WORKERS`; 1 for local policies."""
    gw = settings.gateway
    if gw.workers:
        return int(gw.workers)
    if settings.engine.kind != "vllm" and gw.stable_upstream is None:
        return 1
    return max(1, min(usable_cores(), workers_in_memory(), AUTO_MAX_WORKERS))


def usable_cores(cgroup: Path = Path("/sys/fs/cgroup/cpu.max")) -> int:
    """The CPU affinity of this process, capped by its cgroup's CPU quota when it has one."""
    cores = len(os.sched_getaffinity(0))
    try:
        quota, period = cgroup.read_text().split()[:2]
        if quota != "max":
            cores = min(cores, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def workers_in_memory(cgroup: Path = Path("/sys/fs/cgroup/memory.max")) -> int:
    """Workers the cgroup's memory limit holds (:data:`WORKER_BYTES` each beyond
    :data:`SHARED_BYTES`); :data:`AUTO_MAX_WORKERS` without a limit."""
    try:
        limit = cgroup.read_text().strip()
        if limit != "max":
            return max(1, (int(limit) - SHARED_BYTES) // WORKER_BYTES)
    except (OSError, ValueError):
        pass
    return AUTO_MAX_WORKERS


def spool_dir(settings: Any, port: int) -> Path:
    configured = settings.gateway.spool_dir
    return Path(configured) if configured else Path(tempfile.gettempdir()) / f"rtrl-gateway-{port}"


# --------------------------------------------------------------------- the parent


def serve(settings: Any) -> int:
    """Run the gateway's workers and shipper until SIGTERM; 0, 1 when a worker keeps dying,
    2 when the spool directory cannot be used."""
    try:
        pool = WorkerPool(settings)
    except SpoolDirError as exc:  # not a port already in use: that raises as it always did
        log.error("cannot spool served events: %s", exc)
        return 2
    stopper = Stopper().install()
    try:
        pool.start()
        log.info("gateway on http://%s:%d (API, /metrics, /healthz, /readyz): %d workers, served "
                 "events spooled in %s", settings.gateway.host, pool.port, len(pool.workers), pool.spool)
        return pool.supervise(stopper)
    finally:
        log.info("stopping: draining requests, then shipping the spooled served events")
        pool.stop()


def _create_local_store(settings: Any) -> None:
    """A local sqlite MLflow store is created by its first user: create it here, once, rather
    than in every worker at the same moment (they would race to create its tables)."""
    if settings.gateway.stable_upstream is None and str(settings.mlflow.tracking_uri).startswith("sqlite:"):
        registry(settings).alias_version("champion")


class WorkerPool:
    """The parent's side: the socket (bound here, so ``port=0`` works and :attr:`port` is known
    at once), the spool directory (checked here), the metrics directory, the processes."""

    def __init__(self, settings: Any) -> None:
        gw = settings.gateway
        self._settings = settings
        self._sock = listen_socket(gw.host, gw.port, gw.listen_backlog)
        self.port = int(self._sock.getsockname()[1])
        try:
            self.spool = private_dir(spool_dir(settings, self.port))
        except BaseException:
            self._sock.close()
            raise
        self._metrics = Path(tempfile.mkdtemp(prefix="rtrl-gateway-metrics-"))
        # before any child imports prometheus_client
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(self._metrics)
        self._ctx = mp.get_context("spawn")  # never fork a process that runs threads
        n = worker_count(settings)
        self.workers: list[Any] = [None] * n
        self._started = [0.0] * n
        self._quick = [0] * n
        self._stop_shipping = self._ctx.Event()
        self._shipper: Any = None

    def start(self) -> WorkerPool:
        _create_local_store(self._settings)
        self._start_shipper()
        for i in range(len(self.workers)):
            self._start_worker(i)
        return self

    def _start_worker(self, i: int, replaces: int | None = None) -> None:
        p = self._ctx.Process(target=worker_main, args=(self._settings, self._sock, self.spool, i, replaces),
                              name=f"rtrl-gateway-{i}", daemon=True)
        p.start()
        self.workers[i], self._started[i] = p, time.monotonic()

    def _start_shipper(self) -> None:
        self._shipper = self._ctx.Process(target=shipper_main, args=(self._settings, self.spool,
                                                                     self._stop_shipping),
                                          name="rtrl-gateway-shipper", daemon=True)
        self._shipper.start()

    def supervise(self, stopper: Stopper) -> int:
        """Replace workers and the shipper that die, until ``stopper``; 1 when a worker keeps
        dying right after it started."""
        while not stopper.wait(0.5):
            for i, p in enumerate(self.workers):
                if not p.is_alive() and not self._replace(i, p):
                    return 1
            if not self._shipper.is_alive():
                log.error("the shipper of served events exited (code %s); starting another",
                          self._shipper.exitcode)
                self._start_shipper()
        return 0

    def _replace(self, i: int, p: Any) -> bool:
        _forget(p.pid)
        quick = time.monotonic() - self._started[i] < QUICK_EXIT_S
        self._quick[i] = self._quick[i] + 1 if quick else 0
        if self._quick[i] >= 3:
            log.error("gateway worker %d exited %d times within %.0fs of starting (last code %s): "
                      "stopping the gateway (see the worker's log above)", i, self._quick[i],
                      QUICK_EXIT_S, p.exitcode)
            return False
        log.error("gateway worker %d (pid %s) exited with code %s; starting another", i, p.pid, p.exitcode)
        self._start_worker(i, replaces=p.pid)
        return True

    def stop(self, drain_s: float = 5.0) -> None:
        """SIGTERM the workers and let them drain, then let the shipper deliver what is left."""
        alive = [p for p in self.workers if p is not None and p.is_alive()]
        try:
            for p in alive:
                p.terminate()  # SIGTERM: stop accepting, finish what is in flight
            _join(alive, drain_s + 10.0)
            for p in self.workers:
                if p is not None and p.pid is not None:
                    _forget(p.pid)
        finally:  # interrupted or not, the shipper is told: it would otherwise outlive its owner
            self._stop_shipping.set()
            if self._shipper is not None:
                _join([self._shipper], 20.0)
        self._sock.close()
        shutil.rmtree(self._metrics, ignore_errors=True)


def _join(procs: list[Any], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            log.warning("%s did not stop in time; killing it", p.name)
            p.kill()
            p.join(2.0)


def _forget(pid: int) -> None:
    """Drop a dead process's live gauges from the combined metrics."""
    multiprocess.mark_process_dead(pid)


def _watch_parent(stopper: Stopper) -> None:
    """Stop this child when the parent is gone (killed: it never said so)."""
    parent = os.getppid()

    def watch() -> None:
        while not stopper.wait(1.0):
            if os.getppid() != parent:
                log.error("the gateway's parent process is gone: stopping")
                stopper.stop()

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


# --------------------------------------------------------------------- the children


def worker_main(settings: Any, sock: socket.socket, spool: Path, index: int, replaces: int | None) -> None:
    setup_logging(settings.log_level, f"gateway-{index}")
    name_process(f"rtrl-gw-{index}")
    BUILD_INFO.info({"rtrl_service": "gateway"})
    if replaces is not None:
        GATEWAY_WORKER_RESTARTS.inc()
        log.info("gateway worker %d (pid %d) replaces pid %d", index, os.getpid(), replaces)
    gw = settings.gateway
    stopper = Stopper().install()
    _watch_parent(stopper)
    health = Health(liveness_timeout_s=max(30.0, 10 * gw.routing_poll_s))
    exposures = SpooledExposures(spool, f"w{index}")
    gateway, parts = build(settings, health, exposures=exposures, metrics=multiprocess_registry("gateway"))
    if not await_ready(health, stopper, READY_WAIT_S):
        log.warning("gateway worker %d not ready after %.0f s (failing: %s): accepting connections anyway",
                    index, READY_WAIT_S, health.ready()[1].get("failing"))
    # Everything built so far lives as long as the worker: out of the collector's sight, a full
    # collection walks only what requests left behind (a few ms, not the 100-400 ms pause of
    # walking every imported module's objects in the middle of a request).
    gc.collect()
    gc.freeze()
    server = GatewayServer(gateway, gw.host, 0, sock=sock).start()
    stopper.wait()
    server.stop()
    for part in parts:
        part.stop()


def await_ready(health: Health, stopper: Stopper, timeout_s: float, poll_s: float = 0.05) -> bool:
    """Wait until ``health`` is ready (True), or ``timeout_s`` passed or the worker is asked to
    stop (False)."""
    deadline = time.monotonic() + timeout_s
    while not health.ready()[0]:
        if time.monotonic() >= deadline or stopper.wait(poll_s):
            return False
    return True


def shipper_main(settings: Any, spool: Path, stop: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent says when, after the workers drained
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    setup_logging(settings.log_level, "gateway-shipper")
    name_process(SHIPPER_NAME)
    os.nice(SHIPPER_NICE)  # on busy cores the workers answering users go first; the spool waits
    gw = settings.gateway

    def gauge(depth: int, age_s: float) -> None:
        GATEWAY_SPOOL_BYTES.set(depth)
        GATEWAY_SPOOL_AGE.set(age_s)

    shipper = SpoolShipper(spool, lambda: make_event_producer(settings), exposure_events, count_exposures,
                           Limits(max_bytes=gw.spool_max_bytes, max_age_s=gw.spool_max_age_s), gauge)
    parent = os.getppid()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            if stop.wait(0.5) or os.getppid() != parent:
                done.set()

    threading.Thread(target=watch, name="stop-watch", daemon=True).start()
    while True:
        try:
            shipper.run(done)
            return
        except SpoolBusyError as exc:  # another shipper (an orphan of a killed gateway) still ships
            if done.is_set():
                return
            log.warning("%s; waiting for it", exc)
            done.wait(2.0)
