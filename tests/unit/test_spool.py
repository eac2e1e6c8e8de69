"""The on-disk spool of served events (services/runtime/spool/store.py) and its shipper
(services/runtime/spool/ship.py), with an in-memory sender standing in for the broker."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from services.runtime.health import Health
from services.runtime.process import Stopper
from services.runtime.spool import store as spool
from services.runtime.spool.ship import Limits, SpoolShipper
from services.runtime.spool.store import SpoolBusyError, SpoolDirError, SpoolWriter
from services.wiring.gateway_workers import await_ready, usable_cores, workers_in_memory


class Future:
    def __init__(self, error: Exception | None) -> None:
        self.error = error

    def get(self, timeout: float | None = None) -> None:
        if self.error is not None:
            raise self.error


class Broker:
    """Takes records; ``down`` makes every acknowledgement fail."""

    def __init__(self) -> None:
        self.got: list[dict[str, Any]] = []
        self.down = False

    def send(self, event: dict[str, Any]) -> Future:
        if len(json.dumps(event)) > 10_000:
            raise ValueError("too large")
        self.got.append(event)
        return Future(ConnectionError("broker down") if self.down else None)

    def flush(self, timeout: float | None = None) -> None:
        pass

    def close(self, timeout: float | None = None) -> None:
        pass


def convert(record: dict[str, Any]) -> list[dict[str, Any]]:
    if "id" not in record:
        raise ValueError("no id")
    return [record]


def shipper(directory: Path, broker: Broker, counts: Counter[str], **limits: Any) -> SpoolShipper:
    return SpoolShipper(directory, lambda: broker, convert, lambda r, n: counts.update({r: n}),
                        Limits(**limits))


def test_lines_round_trip_and_only_complete_lines_count() -> None:
    when = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    line = spool.encode({"id": "a", "ts": when, "n": [1, 2]}, 12.5)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert spool.decode(line) == (12.5, {"id": "a", "ts": "2026-01-02T03:04:05+00:00", "n": [1, 2]})
    for bad in (b"[]", b'{"record": 1, "at": 1}', b'{"record": {}, "at": true}', b"{"):
        with pytest.raises(ValueError):
            spool.decode(bad)
    data = b'{"a":1}\n{"b":2}\n{"c":'
    assert spool.complete_lines(data) == ([b'{"a":1}', b'{"b":2}'], 16)
    assert spool.complete_lines(b'{"c":') == ([], 0)
    assert spool.complete_lines(b"x\r\ny\n") == ([b"x\r", b"y"], 5)  # only \n ends a record


def test_records_are_shipped_in_order_once_and_a_closed_segment_goes(tmp_path: Path) -> None:
    writer = SpoolWriter(tmp_path, "w0", segment_bytes=200).open()
    for i in range(10):
        assert writer.append({"id": f"r{i}"})
    broker, counts = Broker(), Counter[str]()
    ship = shipper(tmp_path, broker, counts)
    handled, depth = ship.ship_once()
    assert handled == 10 and depth == 0
    assert [e["id"] for e in broker.got] == [f"r{i}" for i in range(10)]
    assert ship.ship_once() == (0, 0) and len(broker.got) == 10  # nothing twice
    assert len(spool.segments(tmp_path)) == 1  # rotated ones are gone; the open one stays
    writer.close()
    ship.ship_once()
    assert spool.segments(tmp_path) == [] and counts == {"sent": 10}


def test_a_failed_delivery_is_retried_and_counted_once_when_it_goes_through(tmp_path: Path) -> None:
    writer = SpoolWriter(tmp_path, "w0").open()
    for i in range(3):
        writer.append({"id": f"r{i}"})
    broker, counts = Broker(), Counter[str]()
    broker.down = True
    ship = shipper(tmp_path, broker, counts)
    handled, depth = ship.ship_once()
    assert handled == 0 and depth > 0 and counts == {"failed": 3}
    assert spool.read_status(tmp_path).healthy is False
    broker.down = False
    broker.got.clear()
    assert ship.ship_once()[0] == 3
    assert [e["id"] for e in broker.got] == ["r0", "r1", "r2"] and counts == {"failed": 3, "sent": 3}
    assert spool.read_status(tmp_path).healthy is True


def test_unsendable_expired_and_torn_records_are_counted_not_retried(tmp_path: Path) -> None:
    writer = SpoolWriter(tmp_path, "w0").open()
    writer.append({"no": "id"})
    writer.append({"id": "big", "pad": "x" * 20_000})
    writer.append({"id": "ok"})
    writer.close()
    seg = spool.segments(tmp_path)[0]
    with seg.open("ab") as f:
        f.write(spool.encode({"id": "old"}, time.time() - 7200))
        f.write(b'{"at": 1, "record": {"id": "to')  # a writer killed mid-line
    broker, counts = Broker(), Counter[str]()
    ship = shipper(tmp_path, broker, counts, max_age_s=3600)
    ship.ship_once()
    assert [e["id"] for e in broker.got] == ["ok"]
    assert counts == {"sent": 1, "invalid": 3, "dropped": 1}
    assert spool.segments(tmp_path) == []


def test_a_full_spool_refuses_records_until_it_drains(tmp_path: Path) -> None:
    writer = SpoolWriter(tmp_path, "w0").open()
    broker, counts = Broker(), Counter[str]()
    broker.down = True
    ship = shipper(tmp_path, broker, counts, max_bytes=300)
    while spool.read_status(tmp_path).bytes < 300:
        assert writer.append({"id": "x" * 50})
        ship.ship_once()
    assert spool.read_status(tmp_path).full
    time.sleep(1.01)  # writers re-read the status once a second
    assert writer.append({"id": "refused"}) is False
    broker.down = False
    ship.ship_once()
    time.sleep(1.01)
    assert not spool.read_status(tmp_path).full and writer.append({"id": "taken"})


def test_records_of_a_sigkilled_writer_are_all_shipped(tmp_path: Path) -> None:
    code = (
        "import os, signal, sys\n"
        "from pathlib import Path\n"
        "from services.runtime.spool.store import SpoolWriter\n"
        "w = SpoolWriter(Path(sys.argv[1]), 'w0', segment_bytes=4096).open()\n"
        "for i in range(500):\n"
        "    w.append({'id': f'r{i}'})\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=Path(__file__).parents[2])
    assert proc.returncode == -signal.SIGKILL
    broker, counts = Broker(), Counter[str]()
    shipper(tmp_path, broker, counts).ship_once()
    assert [e["id"] for e in broker.got] == [f"r{i}" for i in range(500)]
    assert spool.segments(tmp_path) == []  # its lock died with it


def test_a_shipper_killed_before_its_offset_moved_sends_again_with_the_same_ids(tmp_path: Path) -> None:
    writer = SpoolWriter(tmp_path, "w0").open()
    writer.append({"id": "r0"})
    seg = spool.segments(tmp_path)[0]
    broker = Broker()
    shipper(tmp_path, broker, Counter()).ship_once()
    spool.set_offset(seg, 0)  # as if killed between the acknowledgement and the offset
    shipper(tmp_path, broker, Counter()).ship_once()
    assert [e["id"] for e in broker.got] == ["r0", "r0"]  # the consumer drops the repeat by id


def test_one_shipper_per_spool(tmp_path: Path) -> None:
    with spool.exclusive(tmp_path), pytest.raises(SpoolBusyError), spool.exclusive(tmp_path):
        pass
    with spool.exclusive(tmp_path):  # released
        pass


def test_usable_cores_follows_the_cgroup_quota(tmp_path: Path) -> None:
    cpu_max = tmp_path / "cpu.max"
    affinity = len(os.sched_getaffinity(0))
    cpu_max.write_text("max 100000\n")
    assert usable_cores(cpu_max) == affinity
    cpu_max.write_text("50000 100000\n")
    assert usable_cores(cpu_max) == 1
    cpu_max.write_text(f"{150000 * affinity} 100000\n")
    assert usable_cores(cpu_max) == affinity
    assert usable_cores(tmp_path / "absent") == affinity


@pytest.mark.parametrize(("workers", "engine", "upstream", "expected"), [
    (3, "local", False, 3), (0, "local", False, 1), (0, "vllm", False, "cores"), (0, "local", True, "cores"),
])
def test_worker_count(workers: int, engine: str, upstream: bool, expected: int | str) -> None:
    from types import SimpleNamespace

    from services.wiring.gateway_workers import worker_count

    gateway = SimpleNamespace(workers=workers, stable_upstream=object() if upstream else None)
    settings = SimpleNamespace(gateway=gateway, engine=SimpleNamespace(kind=engine))
    auto = min(usable_cores(), workers_in_memory(), 8)
    assert worker_count(settings) == (auto if expected == "cores" else expected)


def test_workers_in_memory_follows_the_cgroup_limit(tmp_path: Path) -> None:
    memory_max = tmp_path / "memory.max"
    memory_max.write_text("max\n")
    assert workers_in_memory(memory_max) == 8
    memory_max.write_text(f"{1 << 30}\n")  # 1 GiB: the parent and shipper, and 2 workers
    assert workers_in_memory(memory_max) == 2
    memory_max.write_text(f"{300 << 20}\n")  # too little even for one: still one
    assert workers_in_memory(memory_max) == 1
    assert workers_in_memory(tmp_path / "absent") == 8


def test_the_spool_directory_must_be_private(tmp_path: Path) -> None:
    mine = tmp_path / "new"
    SpoolWriter(mine, "w0").open().close()
    assert stat.S_IMODE(mine.stat().st_mode) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)  # another local user could plant records the shipper would sign
    with pytest.raises(SpoolDirError, match="mode 0700"):
        SpoolWriter(shared, "w0").open()
    with pytest.raises(SpoolDirError), spool.exclusive(shared):
        pass
    link = tmp_path / "link"
    link.symlink_to(mine)
    with pytest.raises(SpoolDirError, match="symlink"):
        SpoolWriter(link, "w0").open()


def test_a_spool_directory_that_cannot_be_made_is_a_spool_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(SpoolDirError, match="cannot create spool directory"):
        SpoolWriter(blocker / "spool", "w0").open()


def test_a_worker_waits_to_accept_until_it_can_serve_but_not_for_ever() -> None:
    """await_ready returns as soon as the worker is ready, False at its deadline or when the
    worker is told to stop first."""
    loaded_at = time.monotonic() + 0.3
    health = Health()
    health.add_check("champion_loaded", lambda: time.monotonic() >= loaded_at)
    health.add_check("broker", lambda: False, required=False)  # advisory: never waited for
    t0 = time.monotonic()
    assert await_ready(health, Stopper(), timeout_s=10.0)
    assert 0.29 <= time.monotonic() - t0 < 2.0

    never = Health()
    never.add_check("champion_loaded", lambda: False)
    t0 = time.monotonic()
    assert not await_ready(never, Stopper(), timeout_s=0.3)
    assert 0.29 <= time.monotonic() - t0 < 2.0
    stopped = Stopper()
    stopped.stop()
    t0 = time.monotonic()
    assert not await_ready(never, stopped, timeout_s=10.0)
    assert time.monotonic() - t0 < 1.0
