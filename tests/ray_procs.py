"""Processes of one local Ray node, found from /proc: a machine may run several (another test
worker's, a demo's), and a test must only ever look at or kill its own."""

from __future__ import annotations

import re
from pathlib import Path


def ray_processes_of(driver_pid: int) -> list[int]:
    """Processes of the local Ray node a driver started (its session dir ends with the driver's
    pid): they outlive the driver when its shutdown failed, so they are found by name."""
    pattern = re.compile(rf"session_[0-9_-]+_{driver_pid}(?![0-9])")
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmdline = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if pattern.search(cmdline):
                found.append(int(d.name))
    return found


def descendants_named(root_pid: int, marker: str) -> list[int]:
    """Processes under ``root_pid`` (children, their children, ...) whose command line contains
    ``marker``. Ray workers rename themselves (``ray::RayTrainWorker``), so their command line no
    longer names the session; the raylet that started them is a child of the driver."""
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue  # gone since the listing
            kids.setdefault(ppid, []).append(int(d.name))
    found, todo = [], list(kids.get(root_pid, []))
    while todo:
        pid = todo.pop()
        todo += kids.get(pid, [])
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if marker.encode() in cmdline:
            found.append(pid)
    return found
