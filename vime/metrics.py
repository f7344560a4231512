"""Run metrics: one JSON object per training step, plus TensorBoard when installed.

RUN_DIR/metrics.jsonl is the record of a run; each line is written and
flushed as the step ends, so a crashed run keeps every finished step and
the driver can follow the file while the run goes. TensorBoard event files
go to RUN_DIR/tensorboard when the ``tensorboard`` package is importable.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any


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
                if key != "step" and isinstance(value, (int, float)):
                    self._board.add_scalar(key, value, row["step"])
            self._board.flush()

    def close(self) -> None:
        self._file.close()
        if self._board is not None:
            self._board.close()


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
