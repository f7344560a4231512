"""Resumable checkpoints: RUN_DIR/checkpoints/step_N, written atomically.

A checkpoint holds what the trainer and the buffer need to continue as if
nothing had happened: the policy (a Hugging Face folder, ``model/``), the
optimizer, scheduler, value model and RNG (``trainer.pt``), and the buffer's
state (``buffer.vmsg``: the data cursor, injected prompts, finished groups
and the requests in flight). It is written into a temporary folder, synced,
and renamed into place; then ``latest`` is replaced to name it. A crash at
any moment leaves the previous checkpoint whole and named by ``latest``.
The newest ``KEEP`` checkpoints are kept.

Records are stored in the wire format (``vime.transports.codec``), so a
checkpoint is read back with the same validation as a message; ``trainer.pt``
is read with ``torch.load(weights_only=True)``, which refuses code objects.

The router keeps its own state current beside the checkpoints
(``checkpoints/router.json``, :func:`write_json`): its counters and the groups
it holds, read back by a resumed router, so that a resumed run's summary still
counts the re-issues before the crash and the groups the router held then.

The trainer's writes are here too: :func:`save_training` (a resumable
checkpoint of the engine, its tokenizer and the buffer's state) and
:func:`export_hf` (the policy as a Hugging Face folder, usable as
``--model-path``: RUN_DIR/checkpoint after the last step, RUN_DIR/hf/step_N
every ``--save-hf-every`` steps).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from vime.transports.codec import BadMessage, Envelope, decode_frame, encode, encode_frame

if TYPE_CHECKING:
    from vime.backends.base import TrainEngine

KEEP = 2


def folder(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def write_folder(final: Path, write: Callable[[Path], None]) -> Path:
    """Fill ``final`` with ``write(tmp_folder)`` beside it, synced, then renamed into place:
    a reader (or a crash) never meets half a folder. A folder already there is replaced."""
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    _sync_tree(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def save(run_dir: str | Path, step: int, write: Callable[[Path], None]) -> Path:
    """Write checkpoint ``step`` with ``write(tmp_folder)``, then publish it atomically."""
    root = folder(run_dir)
    final = write_folder(root / f"step_{step:08d}", write)
    pointer = root / "latest.tmp"
    pointer.write_text(final.name + "\n")
    _sync_file(pointer)
    os.replace(pointer, root / "latest")
    _sync_dir(root)
    for old in sorted(root.glob("step_*"))[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def save_training(run_dir: str | Path, step: int, engine: TrainEngine, tokenizer: Any, buffer_state: Any) -> Path:
    """A resumable checkpoint after ``step`` steps: the engine's state, its tokenizer beside the policy, and the
    buffer's state (asked for right after the step's version was published, so the two agree)."""
    def write(folder: Path) -> None:
        engine.save(folder)
        tokenizer.save_pretrained(folder / "model")
        write_record(folder / "buffer.vmsg", buffer_state)

    return save(run_dir, step, write)


def export_hf(folder: Path, engine: TrainEngine, tokenizer: Any) -> Path:
    """The policy and its tokenizer as a Hugging Face folder (loadable as --model-path), written whole."""
    def write(tmp: Path) -> None:
        engine.save_hf(tmp)
        tokenizer.save_pretrained(tmp)

    return write_folder(folder, write)


def write_json(path: Path, document: Any) -> None:
    """``document`` as JSON at ``path``, replaced whole (a reader, or a kill -9, never meets half a file);
    not synced: for state kept current while a run goes on, where the newest few writes may be lost. The
    folder is made if missing (an actor may write before the trainer's first checkpoint makes it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(document))
    os.replace(tmp, path)


def read_json(path: Path) -> Any:
    """What :func:`write_json` wrote; None when there is no such file."""
    return json.loads(path.read_text()) if path.is_file() else None


def latest(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run, or None when it wrote none."""
    pointer = folder(run_dir) / "latest"
    if not pointer.exists():
        return None
    path = folder(run_dir) / pointer.read_text().strip()
    return path if path.is_dir() else None


def step_of(checkpoint: Path) -> int:
    """The number of training steps done when ``checkpoint`` was written."""
    return int(checkpoint.name.removeprefix("step_"))


def write_record(path: Path, record: Any) -> None:
    """A message record to a file, in the wire format."""
    envelope = Envelope(type(record).__name__, "checkpoint", "checkpoint", 0, None, 0.0, None, False, record)
    path.write_bytes(encode_frame("", None, [encode(envelope)]))


def read_record(path: Path, kind: type) -> Any:
    """The record in ``path``, validated; ValueError when it is not a ``kind``."""
    frame = decode_frame(path.read_bytes(), max_message_bytes=1 << 40)
    item = frame.messages[0] if len(frame.messages) == 1 else None
    if isinstance(item, BadMessage) or item is None or not isinstance(item.payload, kind):
        detail = item.error if isinstance(item, BadMessage) else "wrong kind"
        raise ValueError(f"{path} does not hold a {kind.__name__} ({detail}); the checkpoint is damaged")
    return item.payload


def _sync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            _sync_file(path)
    for path in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        _sync_dir(path)


def _sync_file(path: Path) -> None:
    with path.open("rb+") as file:
        os.fsync(file.fileno())


def _sync_dir(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
