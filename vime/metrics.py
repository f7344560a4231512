"""Run metrics: one JSON object per training step, plus TensorBoard when installed.

RUN_DIR/metrics.jsonl is the record of a run; each line is written and
flushed as the step ends, so a crashed run keeps every finished step and
the driver can follow the file while the run goes. TensorBoard event files
go to RUN_DIR/tensorboard when the ``tensorboard`` package is importable.
"""

from __future__ import annotations

import json
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


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every complete line of RUN_DIR/metrics.jsonl (a line still being written is skipped)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows
