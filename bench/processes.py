"""The servers of ``rtrl bench gateway --mode vllm``, each in its own process as deployed.

A gateway, an engine and their clients never share an interpreter in production. Measured in
one process, the 64 client threads, the stand-in engine's threads and the gateway's workers
queue for one GIL, and the figure is the benchmark's own contention. :class:`Apart` runs a
server in a spawned process and hands back its URL; :class:`TcpRelay` is the baseline of
the same run: bytes piped between client and engine with no parsing, the least any proxy
in front of the engine can add on this machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any, Protocol, Self

from bench.fake_engine import FakeEngine
from services.runtime.process import setup_logging
from services.wiring.gateway_workers import WorkerPool


class Server(Protocol):
    @property
    def url(self) -> str: ...

    def stop(self) -> None: ...


def _serve(factory: Callable[..., Server], args: tuple[Any, ...], conn: Any) -> None:
    """The child: start the server, send its URL (or the error), serve until told to stop or
    until the parent is gone. Ctrl-C reaches the whole process group: the parent's stop says
    when, so a stop is not cut short half-way (a gateway left with its shipper running)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        server = factory(*args)
    except Exception as exc:  # the parent reports it; a traceback in a child's stderr is easy to miss
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("url", server.url))
    with contextlib.suppress(EOFError, OSError):
        conn.recv()
    server.stop()


class Apart:
    """``factory(*args)`` (an importable function returning a started :class:`Server`) in a
    spawned process."""

    def __init__(self, factory: Callable[..., Server], *args: Any) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        # not a daemon: the gateway starts its own workers and shipper, which a daemon may not
        self._proc = ctx.Process(target=_serve, args=(factory, args, child),
                                 name=getattr(factory, "__name__", "server"))
        self.url = ""

    def start(self, timeout_s: float = 180.0) -> Self:
        self._proc.start()
        if not self._conn.poll(timeout_s):
            self.stop()
            raise RuntimeError(f"{self._proc.name} did not start within {timeout_s:.0f} s")
        kind, value = self._conn.recv()
        if kind == "error":
            self.stop()
            raise RuntimeError(f"{self._proc.name} failed to start: {value}")
        self.url = value
        return self

    def cpu_s(self, children: bool = True, skip: str | None = None) -> float:
        """CPU seconds the server's process (and its children, but those named ``skip``) has
        used so far."""
        return tree_cpu_s(self._proc.pid, children, skip) if self._proc.pid is not None else float("nan")

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.send("stop")
        self._proc.join(15)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(5)
        self._conn.close()


def tree_cpu_s(pid: int, children: bool = True, skip: str | None = None) -> float:
    """CPU seconds (user + system) a process and (``children``) its live descendants have
    used (Linux ``/proc``; NaN where there is none): what serving cost a server, its helper
    processes included (the gateway's exposure writer), but a descendant whose process name
    is ``skip`` (and its own descendants)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    cpu: dict[int, float] = {}
    kids: dict[int, list[int]] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return float("nan")
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat") as fh:
                comm, rest = fh.read().split("(", 1)[1].rsplit(")", 1)
                fields = rest.split()
        except (OSError, IndexError, ValueError):
            continue  # gone since the listing
        if skip is not None and comm == skip and int(entry) != pid:
            continue  # neither it nor, unreachable now, its descendants
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
        kids.setdefault(int(fields[1]), []).append(int(entry))
    if pid not in cpu:
        return float("nan")
    if not children:
        return cpu[pid]
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        total += cpu[current]
        todo.extend(k for k in kids.get(current, ()) if k in cpu)
    return total


class TcpRelay:
    """A do-nothing proxy: each client connection gets its own connection to ``target_url``
    and bytes are piped both ways on one event loop, unread."""

    def __init__(self, target_url: str) -> None:
        host, port = target_url.removeprefix("http://").split(":")
        self._target = (host, int(port))
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tcp-relay", daemon=True)
        self.url = ""

    def start(self) -> Self:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the relay did not start")
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(
            asyncio.start_server(self._client, "127.0.0.1", 0, backlog=1024))
        self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        self._ready.set()
        self._loop.run_forever()
        # Stopped: end the connections still open (their pipes close both sides), then the loop.
        server.close()
        pending = asyncio.all_tasks(self._loop)
        for task in pending:
            task.cancel()
        self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self._loop.close()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.close()
            return
        with contextlib.suppress(asyncio.CancelledError):  # the relay stopping: the pipes close
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    finally:
        writer.close()


def fake_engine(token_ms: float) -> Server:
    """The stand-in engine of ``--fake-engine`` (bench/fake_engine.py), started."""
    return FakeEngine(token_ms).start()


def tcp_relay(target_url: str) -> Server:
    return TcpRelay(target_url).start()


class ServedGateway:
    """The gateway as ``rtrl serve gateway`` runs it: ``gateway.workers`` worker processes on
    one socket, the spool and its shipper (services/wiring/gateway_workers.py), under this
    process. Ready when every worker has answered ``/readyz``."""

    def __init__(self, settings: Any, timeout_s: float = 120.0) -> None:
        setup_logging("WARNING", "bench-gateway")
        self._pool = WorkerPool(settings.model_copy(update={"log_level": "WARNING"})).start()
        self.url = f"http://127.0.0.1:{self._pool.port}"
        self.workers = len(self._pool.workers)
        try:
            wait_ready(self.url, 10 * self.workers, timeout_s)
        except BaseException:
            self._pool.stop()
            raise

    def stop(self) -> None:
        self._pool.stop()


def wait_ready(url: str, in_a_row: int, timeout_s: float) -> None:
    """Until ``in_a_row`` new connections in a row get 200 from ``/readyz``: the kernel hands
    them to any worker, so a worker still loading its model breaks the run."""
    deadline, good = time.monotonic() + timeout_s, 0
    while good < in_a_row:
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=2) as resp:  # noqa: S310 (loopback)
                good = good + 1 if resp.status == 200 else 0
        except OSError:
            good = 0
        if good < in_a_row:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the gateway at {url} was not ready within {timeout_s:.0f} s")
            time.sleep(0.05 if good else 0.2)
