"""The exit codes of every ``rtrl`` command, in one place so scripts can rely on them.

The table is printed by ``rtrl --help`` and documented in docs/operations.md."""

from __future__ import annotations

OK = 0
"""The command did what was asked, or the check passed."""
FAILED = 1
"""A check failed or a request was rejected: ``reconcile`` found lost or duplicated records,
``events validate`` found invalid lines, ``promote``/``rollback`` were rejected, an increment
failed."""
USAGE = 2
"""The command line or the configuration is wrong (unknown command, bad flag, missing key)."""
NOT_DONE = 3
"""Nothing is wrong, but the work was not done now: the controller did not handle a command
within ``--timeout``, another increment is running, a worker was fenced by a newer replica."""
UNAVAILABLE = 4
"""A backend (MLflow, Redis or the Kafka broker) refused the connection or did not answer in
time. Printed as one line naming the backend, its address and the setting that holds it."""
INTERRUPTED = 130
"""Stopped by Ctrl-C (SIGINT)."""

TABLE: tuple[tuple[int, str], ...] = (
    (OK, "ok"),
    (FAILED, "check failed or request rejected"),
    (USAGE, "usage or configuration error"),
    (NOT_DONE, "not done now (controller did not answer in time, another increment runs)"),
    (UNAVAILABLE, "backend unavailable (MLflow, Redis or Kafka did not answer)"),
    (INTERRUPTED, "interrupted (Ctrl-C)"),
)


def epilog() -> str:
    """The exit-code table as ``rtrl --help`` prints it."""
    return "\n".join(["exit codes:", *(f"  {code:<4} {meaning}" for code, meaning in TABLE)])
