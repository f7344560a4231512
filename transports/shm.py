"""Shared-memory segments for large tensors between actors on one host.

The sender copies the bytes once into a segment -- a file in a tmpfs folder
-- and sends only its name; the receiver maps it (no copy) and builds tensors
that view the mapping. When the last of those views is gone the receiver
gives the segment back (the runtime sends ``SegmentsFree``), and the sender
reuses it for a later message. Reuse is the point: writing into pages that
already exist runs at memory speed, while fresh tmpfs pages must first be
allocated and zeroed, which costs more than the copy itself.

A segment is never written while lent. A borrower that dies keeps its loans;
the runtime reclaims them when the driver reports the death. Segments left
when the sender closes are unlinked. Names are checked against the writer's
pattern before anything is opened, so a received name can never point
outside the segment folder.

Segments carry their writer's pid (``vime-PID-...``), and so does the
driver's folder of ipc sockets kept beside them: what a process killed with
``kill -9`` leaves behind is found by that pid. The driver removes a dead
actor's at once (:func:`remove_left_by`) and, as it starts, whatever dead
processes of the same user left (:func:`sweep_stale`). A pid is judged on
this host's process table: processes in another pid namespace that share
this folder would look dead, so give such containers a folder of their own
(``VIME_SHM_DIR``).
"""

from __future__ import annotations

import dataclasses
import itertools
import mmap
import os
import re
import secrets
import shutil
import tempfile
from pathlib import Path

_NAME = re.compile(r"^vime-[0-9]+-[0-9a-f]{8}-[0-9]+$")
_LEFT_BY = re.compile(r"^vime-([0-9]+)-")  # a segment, or a driver's folder of ipc sockets
_GRAIN = 1 << 20  # segment sizes round up to this, so near sizes share segments


def segment_dir() -> Path:
    """``$VIME_SHM_DIR`` when set (a test session's own folder, a container's); else tmpfs when the OS has one
    (Linux), else the temp folder (still correct, slower). Every actor of a host must see the same one."""
    chosen = os.environ.get("VIME_SHM_DIR")
    if chosen:
        return Path(chosen)
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (any user's; a zombie counts until reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def remove_left_by(pid: int, folder: Path | None = None) -> list[str]:
    """Remove the segments and socket folders of process ``pid``, which the caller knows is dead.

    Receivers that still map a segment keep their mapping: only the name goes.
    Returns the names removed.
    """
    folder = folder or segment_dir()
    removed = []
    for entry in folder.glob(f"vime-{pid}-*"):
        if _LEFT_BY.match(entry.name) and entry.lstat().st_uid == os.getuid():
            _remove_entry(entry)
            removed.append(entry.name)
    return removed


def sweep_stale(folder: Path | None = None) -> list[str]:
    """Remove what dead processes of this user left (``kill -9``, a crash, a power cut); returns the names.

    Run by the driver as it starts: nothing else would ever free that memory.
    """
    folder = folder or segment_dir()
    dead = set()
    for entry in folder.glob("vime-*"):
        match = _LEFT_BY.match(entry.name)
        if match and not pid_alive(int(match[1])):
            dead.add(int(match[1]))
    return [name for pid in sorted(dead) for name in remove_left_by(pid, folder)]


def _remove_entry(entry: Path) -> None:
    """Unlink a segment or remove a socket folder; a concurrent sweep may have been first."""
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry, ignore_errors=True)
    else:
        entry.unlink(missing_ok=True)


@dataclasses.dataclass
class _Segment:
    name: str
    fd: int
    capacity: int
    mapping: mmap.mmap
    borrower: str | None = None


class SegmentPool:
    """The segments one sending actor lends to same-host receivers."""

    def __init__(self, folder: Path | None = None, max_idle_bytes: int = 1 << 30) -> None:
        self.folder = folder or segment_dir()
        self.max_idle_bytes = max_idle_bytes
        self._prefix = f"vime-{os.getpid()}-{secrets.token_hex(4)}-"
        self._counter = itertools.count()
        self._segments: dict[str, _Segment] = {}

    def lend(self, data: memoryview, borrower: str) -> str:
        """Copy ``data`` into a free (or new) segment lent to ``borrower``; returns its name."""
        view = data.cast("B")
        segment = self._free_segment(len(view)) or self._new_segment(len(view))
        segment.borrower = borrower
        if len(view):
            _copy(view, segment.mapping)
        return segment.name

    def give_back(self, names: list[str]) -> None:
        """The borrower no longer uses these segments: they may be written again."""
        for name in names:
            segment = self._segments.get(name)
            if segment is not None:
                segment.borrower = None
        self._trim()

    def reclaim(self, borrower: str) -> None:
        """Take back everything lent to a borrower that died."""
        self.give_back([s.name for s in self._segments.values() if s.borrower == borrower])

    @property
    def lent(self) -> int:
        return sum(1 for s in self._segments.values() if s.borrower is not None)

    def _free_segment(self, nbytes: int) -> _Segment | None:
        """The smallest free segment that fits, unless it would waste more than half."""
        fits = [s for s in self._segments.values()
                if s.borrower is None and nbytes <= s.capacity <= 2 * nbytes + _GRAIN]
        return min(fits, key=lambda s: s.capacity, default=None)

    def _new_segment(self, nbytes: int) -> _Segment:
        name = f"{self._prefix}{next(self._counter)}"
        fd = os.open(self.folder / name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        capacity = max(_GRAIN, -(-nbytes // _GRAIN) * _GRAIN)
        os.ftruncate(fd, capacity)
        segment = self._segments[name] = _Segment(name, fd, capacity, mmap.mmap(fd, capacity))
        return segment

    def _trim(self) -> None:
        idle = sorted((s for s in self._segments.values() if s.borrower is None), key=lambda s: -s.capacity)
        total = sum(s.capacity for s in idle)
        for segment in idle:
            if total <= self.max_idle_bytes:
                break
            total -= segment.capacity
            self._remove(segment)

    def _remove(self, segment: _Segment) -> None:
        segment.mapping.close()
        os.close(segment.fd)
        (self.folder / segment.name).unlink(missing_ok=True)
        del self._segments[segment.name]

    def close(self) -> None:
        """Unlink every segment, lent or not (receivers' mappings stay valid)."""
        for segment in list(self._segments.values()):
            self._remove(segment)


def _copy(source: memoryview, mapping: mmap.mmap) -> None:
    """Copy into a segment with torch's threaded copy (a plain memcpy when the source is read-only)."""
    if source.readonly:
        mapping[: len(source)] = source
        return
    import torch  # on the first copy: actors that never lend a segment never import it

    target = torch.frombuffer(mapping, dtype=torch.uint8, count=len(source))
    target.copy_(torch.frombuffer(source, dtype=torch.uint8))


def map_segment(name: str, nbytes: int, folder: Path | None = None) -> mmap.mmap:
    """Map ``nbytes`` of a received segment; the mapping lives as long as its views."""
    if not _NAME.match(name):
        raise ValueError(f"refusing shared-memory name {name!r}: not a vime segment name")
    try:
        fd = os.open((folder or segment_dir()) / name, os.O_RDWR)
    except FileNotFoundError:
        raise ValueError(
            f"shared-memory segment {name} is gone: was the sender on another host, or has it exited?"
        ) from None
    try:
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise ValueError(f"shared-memory segment {name} holds {size} bytes, message says {nbytes}")
        # Lazy: pages are mapped when touched, so what is never read costs nothing.
        return mmap.mmap(fd, max(nbytes, 1), flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
