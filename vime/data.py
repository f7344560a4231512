"""Where prompts come from: a JSONL file or a user's function, in seeded epochs.

Every row is a map with ``prompt`` (text) and ``label``; any other keys go
to the reward function as metadata. The whole source is read at start and
shuffled anew each epoch from the seed, so a run -- and its replay -- sees
the same prompts in the same order.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from vime.plugins import import_function


def check_row(row: Any, where: str) -> dict[str, Any]:
    """The row, or a ValueError saying what a prompt row must look like."""
    if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or "label" not in row:
        raise ValueError(f"{where}: a prompt row must be a map with a 'prompt' string and a 'label', got {row!r:.200}")
    return row


def load_rows(data: str = "", custom_data_source: str = "") -> list[dict[str, Any]]:
    """All rows of the configured source: ``custom_data_source`` (module:function) or the JSONL ``data``."""
    if custom_data_source:
        fn = import_function(custom_data_source, "--custom-data-source")
        return [check_row(row, custom_data_source) for row in fn()]
    if not data:
        raise ValueError("no prompts: pass --data FILE.jsonl or --custom-data-source package.module:function")
    path = Path(data)
    if not path.is_file():
        raise ValueError(f"--data {data}: no such file; pass a JSONL file of {{\"prompt\", \"label\"}} rows")
    rows = []
    with path.open() as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{number}: not JSON ({err}); each line must be a "
                                     "{\"prompt\": ..., \"label\": ...} object") from None
                rows.append(check_row(row, f"{path}:{number}"))
    return rows


class PromptSource:
    """Rows in a seeded order, epoch after epoch (``epochs = 0``: without end)."""

    def __init__(self, rows: list[dict[str, Any]], *, seed: int, epochs: int = 0) -> None:
        if not rows:
            raise ValueError("the prompt source is empty")
        self.rows = rows
        self.seed = seed
        self.epochs = epochs
        self.epoch = 0
        self.index = 0
        self._order = self._shuffled(0)

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def seek(self, epoch: int, index: int) -> None:
        """Continue from a saved position (``epoch``, ``index``): the orders are seeded, so this is all of the state."""
        self.epoch, self.index = epoch, index
        self._order = self._shuffled(epoch)

    def next(self) -> dict[str, Any] | None:
        """The next row, or None once the last epoch is done."""
        if self.index == len(self._order):
            if self.epochs and self.epoch + 1 >= self.epochs:
                return None
            self.epoch += 1
            self.index = 0
            self._order = self._shuffled(self.epoch)
        row = self.rows[self._order[self.index]]
        self.index += 1
        return row
