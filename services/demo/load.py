"""``rtrl demo --load N``: N busy processes beside the demo, so anyone can see how the loop
fares on a busy machine (CI runners, a laptop compiling, a shared node).

Each process spins one core in pure Python and is bounded three ways: the demo stops it when
it ends (SIGTERM, then SIGKILL), it exits by itself when the demo's process is gone (it checks
its parent every few milliseconds, so a SIGKILLed demo leaves no spinner behind), and it gives
up after ``max_s`` seconds whatever happens.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

MAX_LOAD = 64
"""More busy processes than this is a fork bomb, not a busy machine."""
SPIN = """
import os, sys, time
parent, deadline = int(sys.argv[2]), time.monotonic() + float(sys.argv[1])
while os.getppid() == parent and time.monotonic() < deadline:
    for _ in range(20000):
        pass
"""


class BusyLoad:
    """N spinning processes; a context manager (``with BusyLoad(2, 3600): ...``)."""

    def __init__(self, n: int, max_s: float) -> None:
        if not 0 <= n <= MAX_LOAD:
            raise ValueError(f"--load takes 0 to {MAX_LOAD} busy processes, not {n}")
        self.n, self.max_s = n, max_s
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> BusyLoad:
        for _ in range(self.n):
            self.procs.append(subprocess.Popen(  # our own interpreter and a fixed script
                [sys.executable, "-c", SPIN, f"{self.max_s:.0f}", str(os.getpid())], stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        return self

    def running(self) -> int:
        return sum(1 for p in self.procs if p.poll() is None)

    def stop(self, grace_s: float = 2.0) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()

    def __enter__(self) -> BusyLoad:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def describe(self) -> str:
        cores = os.cpu_count() or 1
        return f"{self.n} busy process{'es' if self.n != 1 else ''} beside the demo ({cores} cores)"
