"""Process runtime: logging, and SIGTERM/SIGINT mapped to a clean stop."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import signal
import sys
import threading
from types import FrameType


class Stopper:
    """Set when the process is asked to stop. Long loops check ``stopping`` between batches.

    SIGTERM and SIGINT both request a clean stop: the current batch is finished, offsets
    are committed, and the process exits 0. A second signal is logged and ignored so the
    clean shutdown is not interrupted half-way.
    """

    def __init__(self) -> None:
        self._event = threading.Event()

    @property
    def stopping(self) -> bool:
        return self._event.is_set()

    def stop(self) -> None:
        self._event.set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)

    def install(self) -> Stopper:
        """Take SIGTERM and SIGINT (main thread only); calling it again takes them back from
        a library that replaced them."""
        signal.signal(signal.SIGTERM, self._handler)
        signal.signal(signal.SIGINT, self._handler)
        return self

    def _handler(self, signum: int, _frame: FrameType | None) -> None:
        if self._event.is_set():
            logging.getLogger("rtrl").warning("already stopping (signal %s)", signum)
        else:
            logging.getLogger("rtrl").info("signal %s: finishing the current batch", signum)
        self._event.set()


def setup_logging(level: str = "INFO", service: str = "rtrl") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    # kafka-python is chatty at INFO about every (re)connection.
    logging.getLogger("kafka").setLevel(logging.WARNING)


def name_process(name: str) -> None:
    """Set this process's name as ``ps``, ``top`` and /proc/<pid>/comm show it (Linux, at most
    15 bytes); elsewhere, or when it fails, nothing happens."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # 15: PR_SET_NAME
    except (OSError, AttributeError):
        pass
