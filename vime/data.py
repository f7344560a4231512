"""Where prompts come from: a JSONL file or a user's function, in seeded epochs.

Every row is a map with ``prompt`` (text) and ``label``; any other keys go
to the reward function as metadata. Datasets that name them otherwise
(GSM8K's ``question``/``answer``) are mapped with ``--input-key`` and
``--label-key``. The whole source is read at start and shuffled anew each
epoch from the seed, so a run -- and its replay -- sees the same prompts in
the same order.

How a prompt's text becomes token ids (:func:`prompt_ids`): it is put into
``--prompt-template`` (where ``{prompt}`` stands for it: DAPO's instruction,
say), then, with ``--chat-template``, wrapped as a user turn by the
tokenizer's chat template, thinking on or off (``--no-enable-thinking``) for
templates that know it.
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


def load_rows(data: str = "", custom_data_source: str = "", *, input_key: str = "prompt",
              label_key: str = "label") -> list[dict[str, Any]]:
    """All rows of the configured source: ``custom_data_source`` (module:function) or the JSONL ``data``,
    with ``input_key``/``label_key`` renamed to ``prompt``/``label``."""
    if custom_data_source:
        fn = import_function(custom_data_source, "--custom-data-source")
        return [check_row(_renamed(row, input_key, label_key, custom_data_source), custom_data_source)
                for row in fn()]
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
                rows.append(check_row(_renamed(row, input_key, label_key, f"{path}:{number}"), f"{path}:{number}"))
    return rows


def _renamed(row: Any, input_key: str, label_key: str, where: str) -> Any:
    """The row with its prompt and label under the names the pipeline uses."""
    if (input_key, label_key) == ("prompt", "label") or not isinstance(row, dict):
        return row
    missing = [f"{flag} {key!r}" for flag, key in (("--input-key", input_key), ("--label-key", label_key))
               if key not in row]
    if missing:
        raise ValueError(f"{where}: the row has no {' or '.join(missing)}; its keys are {sorted(row)}")
    rest = {key: value for key, value in row.items() if key not in (input_key, label_key)}
    return {**rest, "prompt": row[input_key], "label": row[label_key]}


def prompt_ids(tokenizer: Any, text: str, *, template: str = "{prompt}", chat: bool = False,
               thinking: bool = True) -> list[int]:
    """The token ids the model is prompted with (see the module's docstring)."""
    text = template.replace("{prompt}", text)
    if not chat:
        return list(tokenizer(text)["input_ids"])
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        enable_thinking=thinking)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def check_prompting(tokenizer: Any, template: str, chat: bool) -> None:
    """ValueError, before a run, for prompt settings the tokenizer cannot serve."""
    if "{prompt}" not in template:
        raise ValueError(f"--prompt-template must contain {{prompt}} where the prompt goes, got {template!r}")
    if chat and not getattr(tokenizer, "chat_template", None):
        raise ValueError("--chat-template: the tokenizer in --model-path has no chat template; "
                         "leave the flag out to prompt with the raw text")


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
