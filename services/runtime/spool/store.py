"""An on-disk spool: processes append records now, one shipper delivers them when it can.

Each writing process appends JSON lines to its own segment files in one directory; one
shipper (:mod:`services.runtime.spool.ship`) reads every segment, hands the records to a
sender and, once the sender has flushed and acknowledged all of them, remembers how far it
got in a small offset file beside the segment. So:

* a record is one ``write(2)`` on an ``O_APPEND`` file: when :meth:`SpoolWriter.append`
  returns, the kernel holds the record even if its process is SIGKILLed the next instant
  (a power loss can still take the page cache: no fsync per record, by design);
* the shipper advances an offset only after the acknowledgements; killed before that, it
  sends those records again. Each record carries an id the consumer deduplicates on
  (served events: ``event_id``, dropped by ingest as a duplicate), so redelivery does not
  double count;
* a writer holds an exclusive ``flock`` on its open segment; the kernel drops it when the
  writer exits or is killed, which is how the shipper knows a segment will not grow any more
  and may be deleted once shipped;
* the spool is bounded: the shipper publishes its depth in a status file, and while it is
  over ``max_bytes`` writers refuse records (counted as dropped). The shipper drops records
  older than its age limit instead of sending them.

Files: ``<writer>-<seq>.seg`` (records), ``<writer>-<seq>.seg.off`` (bytes shipped),
``status.json`` (the shipper's depth and health), ``shipper.lock``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SUFFIX = ".seg"
STATUS = "status.json"
STATUS_STALE_S = 10.0
"""A status older than this means the shipper is not running: writers report unhealthy."""


@dataclass(frozen=True)
class Status:
    """What the shipper last saw, for writers (admission, health) and for on-call."""

    bytes: int = 0
    """Bytes appended but not yet shipped, over all segments."""
    full: bool = False
    """Over the size limit: writers refuse records until the shipper catches up."""
    healthy: bool = False
    """The sender exists and its last delivery was acknowledged."""
    at: float = 0.0


def encode(record: dict[str, Any], now: float) -> bytes:
    """One spool line: the record with the time it was spooled. Values JSON cannot hold
    (datetimes) are written as their ISO form."""
    return json.dumps({"at": now, "record": record}, separators=(",", ":"), default=_iso).encode() + b"\n"


def _iso(value: Any) -> str:
    if hasattr(value, "isoformat"):
        return str(value.isoformat())
    raise TypeError(f"cannot spool a {type(value).__name__}")


def decode(line: bytes) -> tuple[float, dict[str, Any]]:
    """(spooled at, record) of one line; ValueError when it is not one :func:`encode` wrote."""
    doc = json.loads(line)
    if not isinstance(doc, dict) or not isinstance(doc.get("record"), dict):
        raise ValueError("not a spool record")
    at = doc.get("at")
    if not isinstance(at, (int, float)) or isinstance(at, bool):
        raise ValueError("spool record without its time")
    return float(at), doc["record"]


def complete_lines(data: bytes) -> tuple[list[bytes], int]:
    """The newline-terminated lines at the start of ``data`` and the bytes they take; a last
    line without its newline is still being written (or was torn by a crash)."""
    end = data.rfind(b"\n") + 1
    return data[:end].split(b"\n")[:-1], end


def read_status(directory: Path) -> Status:
    try:
        doc = json.loads((directory / STATUS).read_bytes())
        return Status(**{k: doc[k] for k in ("bytes", "full", "healthy", "at")})
    except (OSError, ValueError, KeyError, TypeError):
        return Status()


def write_status(directory: Path, status: Status) -> None:
    tmp = directory / f".{STATUS}.tmp"
    tmp.write_text(json.dumps(asdict(status)))
    os.replace(tmp, directory / STATUS)


def segments(directory: Path) -> list[Path]:
    """Every segment, oldest first for each writer (names sort by writer, then sequence)."""
    return sorted(p for p in directory.iterdir() if p.name.endswith(SUFFIX))


def offset_of(segment: Path) -> int:
    try:
        return int((segment.parent / (segment.name + ".off")).read_text())
    except (OSError, ValueError):
        return 0


def set_offset(segment: Path, offset: int) -> None:
    tmp = segment.parent / f".{segment.name}.off.tmp"
    tmp.write_text(str(offset))
    os.replace(tmp, segment.parent / (segment.name + ".off"))


def remove(segment: Path) -> None:
    for path in (segment, segment.parent / (segment.name + ".off")):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def writer_gone(segment: Path) -> bool:
    """True when no process holds the segment open for writing any more."""
    try:
        fd = os.open(segment, os.O_RDONLY)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # closing drops the lock we may have taken
    return True


class SpoolBusyError(RuntimeError):
    """Another shipper holds the spool."""


class SpoolDirError(RuntimeError):
    """The spool directory is not this user's alone."""


def private_dir(directory: Path) -> Path:
    """Create ``directory`` (mode 0700) or check that it is a real directory of this user that
    nobody else may enter: the shipper signs what it finds there, so a record planted by
    another local user would reach the pipeline as a genuine served event."""
    try:
        directory.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    except OSError as exc:
        raise SpoolDirError(f"cannot create spool directory {directory}: {exc}") from exc
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise SpoolDirError(f"spool directory {directory} is not a directory (a symlink?)")
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise SpoolDirError(
            f"spool directory {directory} must belong to this user with mode 0700 (it has uid "
            f"{st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}); remove it or set RTRL_GATEWAY__SPOOL_DIR")
    return directory


@contextlib.contextmanager
def exclusive(directory: Path, name: str = "shipper.lock") -> Iterator[None]:
    """Hold ``directory``'s lock file: two shippers on one spool would ship it twice."""
    private_dir(directory)
    fd = os.open(directory / name, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SpoolBusyError(f"another process already ships the spool in {directory}") from None
        yield
    finally:
        os.close(fd)


class SpoolWriter:
    """Appends records to this process's segments in ``directory``. ``append`` never blocks
    on the network; it is one ``write(2)``, plus, once a second, a read of the status file."""

    def __init__(self, directory: Path, name: str, segment_bytes: int = 64 << 20) -> None:
        self.directory = directory
        self._name = f"{name}-{os.getpid()}"
        self._segment_bytes = segment_bytes
        self._seq = 0
        self._fd = -1
        self._size = 0
        self._status = Status()
        self._checked = 0.0

    def open(self) -> SpoolWriter:
        private_dir(self.directory)
        self._rotate()
        return self

    def _rotate(self) -> None:
        """Start a new segment. It is created and locked under a hidden name, then renamed:
        the shipper never sees a segment that nobody holds yet."""
        self._seq += 1
        final = self.directory / f"{self._name}-{self._seq:06d}{SUFFIX}"
        tmp = self.directory / f".{final.name}.new"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.replace(tmp, final)
        old, self._fd, self._size = self._fd, fd, 0
        if old >= 0:
            os.close(old)  # the old segment is complete: the shipper may delete it once shipped

    @property
    def status(self) -> Status:
        now = time.time()
        if now - self._checked >= 1.0:
            self._status, self._checked = read_status(self.directory), now
        return self._status

    @property
    def healthy(self) -> bool:
        s = self.status
        return s.healthy and time.time() - s.at < STATUS_STALE_S

    def append(self, record: dict[str, Any]) -> bool:
        """Spool one record; False when the spool is full (the record is not kept)."""
        if self._fd < 0:
            raise RuntimeError("SpoolWriter.append before open()")
        if self.status.full:
            return False
        line = encode(record, time.time())
        try:
            written = os.write(self._fd, line)  # one write: whole in the kernel when it returns
        except OSError:  # e.g. the disk is full
            written = -1
        if written != len(line):
            if written > 0:  # a torn line ends this segment; the shipper skips it
                self._rotate()
            return False
        self._size += written
        if self._size >= self._segment_bytes:
            self._rotate()
        return True

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
