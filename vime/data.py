"""Where prompts come from: a JSONL or Parquet file or a user's function, in seeded epochs.

Every row is a map with ``prompt`` and ``label``; any other keys go to the
reward function as metadata. The prompt is a text, or a conversation (a
list of ``{"role", "content"}`` messages, as verl-style Parquet files hold
it). Datasets that name the fields otherwise (GSM8K's ``question`` and
``answer``) are mapped with ``--input-key`` and ``--label-key``; a dotted key
reaches into nested maps (``reward_model.ground_truth``). The whole source is
read at start and shuffled anew each epoch from the seed, so a run -- and
its replay -- sees the same prompts in the same order.

How a prompt becomes token ids (:func:`prompt_ids`): its text (a
conversation's last user message) is put into ``--prompt-template`` (where
``{prompt}`` stands for it: DAPO's instruction, say), then, with
``--chat-template``, the conversation is rendered by the tokenizer's chat
template, thinking on or off (``--no-enable-thinking``) for templates that
know it. A conversation needs ``--chat-template``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Iterator

from vime.plugins import import_function


def check_row(row: Any, where: str) -> dict[str, Any]:
    """The row, or a ValueError saying what a prompt row must look like."""
    if not isinstance(row, dict) or "label" not in row or not (
            isinstance(row.get("prompt"), str) or _is_conversation(row.get("prompt"))):
        raise ValueError(f"{where}: a prompt row must be a map with a 'prompt' (a string, or a list of "
                         f"{{'role', 'content'}} messages) and a 'label', got {row!r:.200}")
    return row


def _is_conversation(prompt: Any) -> bool:
    return (isinstance(prompt, list) and bool(prompt) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt))


def load_rows(data: str = "", custom_data_source: str = "", *, input_key: str = "prompt",
              label_key: str = "label", flag: str = "--data") -> list[dict[str, Any]]:
    """All rows of the configured source: ``custom_data_source`` (module:function) or the file ``data``
    (JSONL, or Parquet by its ``.parquet`` suffix), with ``input_key``/``label_key`` renamed to
    ``prompt``/``label``. ``flag`` names the setting in errors."""
    if custom_data_source:
        fn = import_function(custom_data_source, "--custom-data-source")
        return [check_row(_renamed(row, input_key, label_key, custom_data_source), custom_data_source)
                for row in fn()]
    if not data:
        raise ValueError(f"no prompts: pass {flag} FILE.jsonl (or .parquet) or --custom-data-source "
                         "package.module:function")
    path = Path(data)
    if not path.is_file():
        raise ValueError(f"{flag} {data}: no such file; pass a JSONL or Parquet file of {{\"prompt\", \"label\"}} "
                         "rows (--input-key/--label-key name other fields)")
    records = _parquet_rows(path) if path.suffix == ".parquet" else _jsonl_rows(path)
    return [check_row(_renamed(row, input_key, label_key, where), where) for where, row in records]


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open() as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                try:
                    yield f"{path}:{number}", json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{number}: not JSON ({err}); each line must be a "
                                     "{\"prompt\": ..., \"label\": ...} object") from None


def _parquet_rows(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet

    try:
        table = pyarrow.parquet.read_table(path)
    except pyarrow.ArrowInvalid as err:
        raise ValueError(f"{path}: not a Parquet file ({err})") from None
    for number, row in enumerate(table.to_pylist()):
        yield f"{path} row {number}", row


def _renamed(row: Any, input_key: str, label_key: str, where: str) -> Any:
    """The row with its prompt and label under the names the pipeline uses."""
    if (input_key, label_key) == ("prompt", "label") or not isinstance(row, dict):
        return row
    found = {key: _lookup(row, key) for key in (input_key, label_key)}
    missing = [f"{flag} {key!r}" for flag, key in (("--input-key", input_key), ("--label-key", label_key))
               if found[key] is _MISSING]
    if missing:
        raise ValueError(f"{where}: the row has no {' or '.join(missing)}; its keys are {sorted(row)}")
    rest = {key: value for key, value in row.items() if key not in (input_key, label_key)}
    return {**rest, "prompt": found[input_key], "label": found[label_key]}


_MISSING = object()


def _lookup(row: dict[str, Any], key: str) -> Any:
    """``row[key]``; a dotted key that is not a field itself walks nested maps (``reward_model.ground_truth``)."""
    if key in row:
        return row[key]
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def prompt_messages(prompt: str | list[dict[str, str]], *, template: str = "{prompt}",
                    chat: bool = False) -> list[dict[str, str]]:
    """The conversation a prompt row stands for, the template applied to its last user message."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif not chat:
        raise ValueError("a prompt given as a conversation (a list of messages) needs --chat-template")
    else:
        messages = [dict(message) for message in prompt]
    last_user = next((i for i in reversed(range(len(messages))) if messages[i]["role"] == "user"), -1)
    messages[last_user]["content"] = template.replace("{prompt}", messages[last_user]["content"])
    return messages


def prompt_ids(tokenizer: Any, prompt: str | list[dict[str, str]], *, template: str = "{prompt}",
               chat: bool = False, thinking: bool = True, tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The token ids the model is prompted with (see the module's docstring); ``tools``: schemas the chat
    template presents."""
    messages = prompt_messages(prompt, template=template, chat=chat)
    if not chat:
        return list(tokenizer(messages[0]["content"])["input_ids"])
    ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, enable_thinking=thinking)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def check_prompting(tokenizer: Any, template: str, chat: bool, rows: list[dict[str, Any]] = ()) -> None:
    """ValueError, before a run, for prompt settings the tokenizer or the rows cannot serve."""
    if "{prompt}" not in template:
        raise ValueError(f"--prompt-template must contain {{prompt}} where the prompt goes, got {template!r}")
    if chat and not getattr(tokenizer, "chat_template", None):
        raise ValueError("--chat-template: the tokenizer in --model-path has no chat template; "
                         "leave the flag out to prompt with the raw text")
    if not chat and any(not isinstance(row["prompt"], str) for row in rows):
        raise ValueError("the prompts are conversations (lists of messages): pass --chat-template to render them")


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
