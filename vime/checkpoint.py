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
every ``--save-hf-every`` steps), and :class:`TrainerSaves`, which decides
when each is written and in which order with the trainer's rows.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import trio

from vime.messages.pipeline import SnapshotQuery
from vime.transports.codec import BadMessage, Envelope, decode_frame, encode, encode_frame

if TYPE_CHECKING:
    from vime.backends.base import TrainEngine
    from vime.config import JobConfig
    from vime.metrics import StepRows
    from vime.runtime import Actor

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


class TrainerSaves:
    """What the trainer writes after a step, and when: the exports before the step's row, the resumable
    checkpoint after it. Each call returns the seconds it took, counted in the ``time_checkpoint_s`` of the
    next row written (this step's for the exports, the next step's for the checkpoint)."""

    def __init__(self, trainer: Actor, run_dir: Path, job: JobConfig, engine: TrainEngine, tokenizer: Any,
                 rows: StepRows) -> None:
        self.trainer, self.run_dir, self.job = trainer, run_dir, job
        self.engine, self.tokenizer, self.rows = engine, tokenizer, rows

    async def before_row(self, step: int) -> float:
        """Before ``step``'s row, so that whoever sees the row finds them (the driver ends the run at the last
        one): a Hugging Face folder every ``save_hf_every`` steps, and RUN_DIR/checkpoint after the last step."""
        started = time.perf_counter()
        if self.job.save_hf_every and (step + 1) % self.job.save_hf_every == 0:
            await self._export(self.run_dir / "hf" / f"step_{step + 1}")
        if step + 1 == self.job.steps:
            await self._export(self.run_dir / "checkpoint")
        return time.perf_counter() - started

    async def after_row(self, step: int) -> float:
        """After ``step``'s row is on disk: a resumable checkpoint every ``save_every`` steps (but the last). A
        checkpoint published before its row lost that row for good when the trainer stopped in between: a
        resumed run keeps the rows up to the checkpoint's step and trains from the next (the soak met it, the
        driver waiting forever for the row)."""
        started = time.perf_counter()
        if self.job.save_every and (step + 1) % self.job.save_every == 0 and step + 1 < self.job.steps:
            await self.rows.until_written(step + 1)
            state = await self.trainer.ask("buffer", SnapshotQuery(step=step + 1), timeout=600.0)
            path = await trio.to_thread.run_sync(save_training, self.run_dir, step + 1, self.engine,
                                                 self.tokenizer, state)
            self.trainer.log.info("checkpoint written", path=str(path), step=step + 1,
                                  rows_written=self.rows.written, groups_in_flight=len(state.in_flight))
        return time.perf_counter() - started

    async def _export(self, folder: Path) -> None:
        await trio.to_thread.run_sync(export_hf, folder, self.engine, self.tokenizer)
        self.trainer.log.info("model exported", path=str(folder), weight_version=self.engine.weight_version)


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
