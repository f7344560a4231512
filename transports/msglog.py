"""Message logs: one append-only file per actor holding every frame it received
and sent, as the raw bytes, with direction, peer and both clocks.

File layout: records, each ``u32 body_len | u32 crc32(body) | body`` with
``body = u32 meta_len | meta (msgpack map) | frame | attachments``. The first
record's direction is ``"open"``; its meta says which actor wrote the log and
with what settings, so a replay can rebuild it. Then ``"in"`` and ``"out"``
records hold frames; a ``"step"`` record (no frame) marks where an actor's own
loop took a step that the messages alone do not place (a rollout worker's
engine step), so a replay takes it at the same point. Shared-memory segments a frame
refers to are unlinked once read, so their bytes are stored after the frame as
*attachments* (only when recording; this is where the log costs a copy).

Crash safety: each record is written with one ``write`` call and checked by
length and CRC. A record torn by a crash is detected by the reader, which
stops before it, and cut off by the next writer, so records after a restart
never hide behind garbage and earlier ones are never touched.
"""

from __future__ import annotations

import dataclasses
import os
import struct
import time
import zlib
from pathlib import Path
from typing import Any, Iterator

import msgpack

STEP = "step"  # the direction of a record marking one step of an actor's own loop

_RECORD = struct.Struct("<II")
_META_LEN = struct.Struct("<I")


@dataclasses.dataclass(slots=True)
class LogRecord:
    direction: str  # "open", "in", "out" or STEP
    peer: str
    wall_time: float
    mono_time: float
    frame: bytes
    attachments: dict[str, bytes]
    meta: dict[str, Any]
    offset: int

    def resolve_shm(self, name: str, nbytes: int) -> bytearray:
        """Stand-in for shared memory when re-decoding this record's frame."""
        try:
            return bytearray(self.attachments[name])
        except KeyError:
            raise ValueError(f"log record at byte {self.offset} lacks shared-memory segment {name}") from None


class LogWriter:
    """Appends records to one actor's log; safe to reopen after a crash."""

    def __init__(self, path: Path, opening: dict[str, Any]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        good_end = scan(self.path).good_end if self.path.exists() else 0
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
        os.ftruncate(self._fd, good_end)
        os.lseek(self._fd, good_end, os.SEEK_SET)
        self.write("open", opening.get("name", ""), b"", {}, opening)

    def write(
        self,
        direction: str,
        peer: str,
        frame: bytes | memoryview,
        attachments: dict[str, bytes | memoryview],
        meta: dict[str, Any] | None = None,
        wall_time: float | None = None,
    ) -> None:
        """Append one record; ``wall_time`` is the actor's own clock reading, when it has one."""
        head = dict(meta or {})
        head.update(
            dir=direction,
            peer=peer,
            wall=time.time() if wall_time is None else wall_time,
            mono=time.monotonic(),
            frame_len=len(frame),
            attachments=[[name, len(data)] for name, data in attachments.items()],
        )
        packed = msgpack.packb(head)
        body = b"".join([_META_LEN.pack(len(packed)), packed, frame, *attachments.values()])
        os.write(self._fd, _RECORD.pack(len(body), zlib.crc32(body)) + body)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


@dataclasses.dataclass
class Scan:
    records: list[LogRecord]
    good_end: int
    problem: str | None  # why reading stopped early, if it did


def scan(path: Path) -> Scan:
    """Read every intact record; stop at the first torn or corrupt one."""
    data = Path(path).read_bytes()
    records: list[LogRecord] = []
    pos = 0
    problem = None
    for item in _records(data):
        if isinstance(item, str):
            problem = item
            break
        record, pos = item
        records.append(record)
    return Scan(records, pos, problem)


def opening(path: Path) -> dict[str, Any] | None:
    """The meta of a log's opening record (who wrote it, with what settings), read without the rest of the
    file; None when it does not start with one."""
    with open(path, "rb") as file:
        head = file.read(_RECORD.size)
        if len(head) < _RECORD.size:
            return None
        length, crc = _RECORD.unpack(head)
        body = file.read(length)
    if len(body) < length or zlib.crc32(body) != crc:
        return None
    record = _parse(body, 0)
    return record.meta if record.direction == "open" else None


def _records(data: bytes) -> Iterator[tuple[LogRecord, int] | str]:
    """Each intact record with the offset just past it; a string says why reading stopped."""
    pos = 0
    while pos < len(data):
        if pos + _RECORD.size > len(data):
            yield f"torn record header at byte {pos} (end of file): skipped"
            return
        length, crc = _RECORD.unpack_from(data, pos)
        body = data[pos + _RECORD.size : pos + _RECORD.size + length]
        if len(body) < length:
            yield f"torn record at byte {pos}: {len(body)} of {length} bytes present (end of file): skipped"
            return
        if zlib.crc32(body) != crc:
            yield f"corrupt record at byte {pos}: checksum mismatch; records from here on are unreadable"
            return
        end = pos + _RECORD.size + length
        yield _parse(body, pos), end
        pos = end


def _parse(body: bytes, offset: int) -> LogRecord:
    (meta_len,) = _META_LEN.unpack_from(body, 0)
    meta = msgpack.unpackb(body[_META_LEN.size : _META_LEN.size + meta_len])
    pos = _META_LEN.size + meta_len
    frame = body[pos : pos + meta["frame_len"]]
    pos += meta["frame_len"]
    attachments = {}
    for name, size in meta["attachments"]:
        attachments[name] = body[pos : pos + size]
        pos += size
    return LogRecord(meta["dir"], meta["peer"], meta["wall"], meta["mono"], frame, attachments, meta, offset)
