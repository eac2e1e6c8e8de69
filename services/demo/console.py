"""The demo's console: time-stamped lines, and stdout kept for ``--json``."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime


def say(msg: str) -> None:
    """One line of the demo's console output, time-stamped."""
    stamp = datetime.now(UTC).strftime("%H:%M:%S")
    print(f"[{stamp}] {msg}", flush=True)


@contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Send file descriptor 1 to stderr until the block ends, for this process and every
    process it starts meanwhile (the stack, the services, Ray, MLflow's client), so that
    stdout carries only the document printed after it (``rtrl demo --json``)."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
