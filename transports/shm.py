"""Shared-memory segments for large tensors between actors on one host.

The sender copies the bytes once into a fresh file in a tmpfs folder and sends
only its name; the receiver maps the file (no copy) and unlinks it at once, so
the memory is freed when the last tensor viewing it is gone -- even if the
receiver dies later. A segment whose message never arrived is removed by the
sender's :meth:`SegmentWriter.close` (an actor calls it on shutdown).

Names are checked against the writer's pattern before anything is opened: a
received name can never point outside the segment folder.
"""

from __future__ import annotations

import itertools
import mmap
import os
import re
import secrets
import tempfile
from pathlib import Path

_NAME = re.compile(r"^vime-[0-9]+-[0-9a-f]{8}-[0-9]+$")


def segment_dir() -> Path:
    """tmpfs when the OS has one (Linux), else the temp folder (still correct, slower)."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


class SegmentWriter:
    """Creates segments for one sending actor and remembers them until closed."""

    def __init__(self, folder: Path | None = None) -> None:
        self.folder = folder or segment_dir()
        self._prefix = f"vime-{os.getpid()}-{secrets.token_hex(4)}-"
        self._counter = itertools.count()
        self._written: list[Path] = []

    def write(self, data: memoryview) -> str:
        """Copy ``data`` into a new segment and return its name."""
        name = f"{self._prefix}{next(self._counter)}"
        path = self.folder / name
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            view = data.cast("B")
            written = 0
            while written < len(view):
                written += os.write(fd, view[written:])
        finally:
            os.close(fd)
        self._written.append(path)
        if len(self._written) > 4096:
            self._forget_consumed()
        return name

    def _forget_consumed(self) -> None:
        self._written = [p for p in self._written if p.exists()]

    def close(self) -> None:
        """Remove the segments no receiver has taken (their messages were lost)."""
        for path in self._written:
            path.unlink(missing_ok=True)
        self._written.clear()


def map_segment(name: str, nbytes: int, folder: Path | None = None) -> mmap.mmap:
    """Map a received segment and unlink it; the mapping lives as long as its views."""
    if not _NAME.match(name):
        raise ValueError(f"refusing shared-memory name {name!r}: not a vime segment name")
    path = (folder or segment_dir()) / name
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        raise ValueError(
            f"shared-memory segment {name} is gone: was the sender on another host, or was it already consumed?"
        ) from None
    try:
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise ValueError(f"shared-memory segment {name} holds {size} bytes, message says {nbytes}")
        if size == 0:
            return mmap.mmap(-1, 1)
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        return mmap.mmap(fd, size, flags=flags)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
