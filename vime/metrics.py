"""Run metrics: one JSON object per training step, plus TensorBoard when installed.

RUN_DIR/metrics.jsonl is the record of a run; each line is written and
flushed as the step ends, so a crashed run keeps every finished step and
the driver can follow the file while the run goes. TensorBoard event files
go to RUN_DIR/tensorboard when the ``tensorboard`` package is importable.

The trainer's rows (:class:`StepRows`): with evaluation on, a step's row waits
(in a writer task; training goes on) for the ``eval/*`` metrics of the version
the step produced when that version is evaluated, so metrics.jsonl holds them
beside the step's own; every eval result, version 0's included, is also
appended to RUN_DIR/eval.jsonl as it arrives. :func:`step_row` is a step's row.
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from vime.tasks import Changed

if TYPE_CHECKING:
    from vime.backends.base import TensorBatch
    from vime.messages.pipeline import Sample


# Row keys that are not curves: the step is the x axis, and wall-clock times (epoch seconds) lose all but 128-s
# steps as a board's float32 scalars.
_NOT_PLOTTED = frozenset({"step", "generate_from", "generate_until"})

class MetricsWriter:
    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")
        self._board = _tensorboard(Path(run_dir) / "tensorboard")

    def write(self, row: dict[str, Any]) -> None:
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._board is not None:
            for key, value in row.items():
                if key not in _NOT_PLOTTED and isinstance(value, (int, float)):
                    self._board.add_scalar(key, value, row["step"])
            self._board.flush()

    @property
    def closed(self) -> bool:
        return self._file.closed

    def sync(self) -> None:
        """The rows written so far, on disk."""
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()
        if self._board is not None:
            self._board.close()


class StepRows:
    """The trainer's rows, appended to metrics.jsonl in step order by :meth:`write_loop` (a task of the
    trainer's), each with the ``eval/*`` metrics of its version when that version is evaluated (``evaluated``).
    ``written`` counts the steps whose row is in the file (a resumed run starts with those before it)."""

    def __init__(self, run_dir: Path, eval_versions: Iterable[int], written: int) -> None:
        self.run_dir = run_dir
        self.writer = MetricsWriter(run_dir)
        self._in, self.unwritten = trio.open_memory_channel[dict[str, Any]](math.inf)
        self.eval_versions = set(eval_versions)
        self.eval_results: dict[int, dict[str, float]] = {}
        self.written = written
        self.changed = Changed()  # a row was written or an eval result arrived

    async def add(self, row: dict[str, Any]) -> None:
        """Queue a step's row; it is written once its version's eval metrics are in (if it is evaluated)."""
        await self._in.send(row)

    def evaluated(self, version: int, metrics: dict[str, float]) -> None:
        """The ``eval/*`` metrics of ``version``: into eval.jsonl now, into its step's row when that is written."""
        self.eval_results[version] = metrics
        with (self.run_dir / "eval.jsonl").open("a") as file:
            file.write(json.dumps({"weight_version": version, **metrics}) + "\n")
        self.changed.notify()

    async def write_loop(self) -> None:
        """Append each step's row in order, with its version's eval metrics when that version is evaluated."""
        async for row in self.unwritten:
            version = row["weight_version"]
            if version in self.eval_versions:
                await self.changed.until(lambda: version in self.eval_results)
                row.update(self.eval_results[version])
            if self.writer.closed:
                return  # the trainer is stopping: nothing is written, and so no checkpoint follows (until_written)
            self.writer.write({k: plain(v) for k, v in row.items()})
            self.written = row["step"]
            self.changed.notify()

    async def until_written(self, steps: int) -> None:
        """Return once the rows of the first ``steps`` steps are written and synced to disk (the last with its
        version's eval metrics, when that version is evaluated): a checkpoint of step ``steps`` written then makes
        a resumed run neither lose nor repeat a row, after a kill -9 or a power cut alike. Never once the rows
        are closed (the trainer is stopping: it writes no checkpoint then). The sync runs on trio's thread, where
        :meth:`close` runs too (a small file's fsync, once a checkpoint)."""
        await self.changed.until(lambda: self.written == steps or self.writer.closed)
        if self.writer.closed:
            await trio.sleep_forever()  # until the stop cancels the caller
        self.writer.sync()

    def close(self) -> None:
        self.writer.close()
        self.changed.notify()


def step_row(step: int, weight_version: int, samples: list[Sample], tensors: TensorBatch, times: dict[str, float],
             tflops: float, memory: dict[str, float], stats: dict[str, float],
             metrics: dict[str, Any], weight_paths: dict[str, str]) -> dict[str, Any]:
    """The row of step ``step`` (counted from 1: step N publishes weight version N and writes checkpoint step_N):
    what it trained on, its time split (``times``: the ``time_*`` seconds and
    ``step_time_s``), ``train_tflops_per_gpu``, the trainer's memory, the batch's stats, the engine's
    metrics, and the path that took the version to each rollout worker (``weight_paths``: which a worker on
    another host got is otherwise only in the trainer's log)."""
    response_tokens = int(tensors.response_mask.sum())
    return {
        "step": step,
        "weight_version": weight_version,
        "raw_reward": statistics.fmean(s.reward for s in samples),
        "samples": len(samples),
        "response_tokens": response_tokens,
        "step_time_s": times["step_time_s"],
        "rollout_tokens_per_s": response_tokens / max(stats["time_generate_s"], 1e-9),
        **{key: times[key] for key in ("time_wait_s", "time_collate_s", "time_sleep_s", "time_drain_s",
                                       "time_train_s")},
        "train_tflops_per_gpu": tflops,
        **{key: times[key] for key in ("time_weight_sync_s", "time_checkpoint_s")},
        "group_ids": sorted({s.group_id for s in samples}),
        "weight_paths": weight_paths,
        **memory,
        **stats,
        **metrics,
    }


def train_tflops_per_gpu(model_config: Any, tensors: TensorBatch, train_s: float, trainer_gpus: int) -> float:
    """The model FLOPs of a step's training (``vime.flops``) over its time, per trainer GPU (``trainer_gpus``:
    1 for a trainer on CPU, counted per process); over a GPU's bf16 matmul peak, the train phase's MFU."""
    from vime.flops import training_flops  # imports torch: not for readers of metrics files

    flops = training_flops(model_config, tensors.attention_mask.sum(1).tolist())
    return flops / max(train_s, 1e-9) / 1e12 / trainer_gpus


def ranges(values: list[int]) -> str:
    """``[1, 2, 3, 5]`` as ``1-3, 5``: a short picture of which steps or ids were there."""
    parts: list[str] = []
    for value in values:
        if parts and value == int(parts[-1].rpartition("-")[2]) + 1:
            parts[-1] = f"{parts[-1].partition('-')[0]}-{value}"
        else:
            parts.append(str(value))
    return ", ".join(parts) if len(parts) < 12 else ", ".join(parts[:5] + ["..."] + parts[-5:])


def plain(value: Any) -> Any:
    """JSON-safe: NaN/inf become None so that metrics.jsonl stays valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def trainer_memory_mib(gpus: list[str]) -> dict[str, float]:
    """This process's resident host memory and, when it trains on GPUs, what torch has allocated on its own."""
    memory = {}
    with contextlib.suppress(OSError):  # /proc is Linux's
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        memory["trainer_rss_mib"] = pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    if gpus:
        import torch

        memory["trainer_gpu_allocated_mib"] = torch.cuda.memory_allocated() / 2**20
    return memory


def _tensorboard(folder: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional
        return None
    return SummaryWriter(str(folder))


class MetricsFollower:
    """Reads the rows appended to RUN_DIR/metrics.jsonl since the last call (a partial line waits)."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self._offset = 0

    def new_rows(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with self.path.open("rb") as file:
            file.seek(self._offset)
            data = file.read()
        complete = data[:data.rfind(b"\n") + 1]
        self._offset += len(complete)
        return [json.loads(line) for line in complete.splitlines() if line.strip()]


def trained_ages(rows: Iterable[dict[str, Any]]) -> collections.Counter[int]:
    """How many trained samples were each number of versions old, summed over ``rows`` (each row counts its
    own in ``staleness_samples_AGE`` keys, one per age present): the staleness histogram of a run."""
    ages: collections.Counter[int] = collections.Counter()
    for row in rows:
        for key, count in row.items():
            if key.startswith("staleness_samples_"):
                ages[int(key.removeprefix("staleness_samples_"))] += count
    return ages
