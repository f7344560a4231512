"""A multi-turn episode kept token in, token out: the tokens trained on are the tokens the engine produced.

Re-tokenizing a model's own text is the classic agentic-RL bug: the
decoded text of a response does not always encode back to the same ids
(merges across a split, thinking tags, tool-call markup), so the trainer
would score tokens the model never sampled. Here the model's tokens are
appended as the engine gave them, with their log-probs and weight
versions; only the text *between* turns -- the tool results wrapped in the
chat template's markup -- is tokenized, and those tokens get loss mask 0.

The markup of a tool turn comes from the tokenizer's own chat template by
difference: render a short conversation -- an assistant turn, the tool
messages, the next generation prompt -- twice, with two different assistant
answers, and keep the tokens the two renderings end with in common: the
assistant turn's closing (``<|im_end|>`` and a newline, for Qwen3), the
tool messages and the prompt. The closing's end token is left out when the
model produced it itself. (Rendering the conversation with and without the
tool messages and taking the difference does not work: Qwen3's template
writes an empty thinking block into a final assistant turn only.)
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclasses.dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    error: str = ""  # set when the call could not be read; the model is told so instead of a result


@dataclasses.dataclass
class Episode:
    """One conversation's tokens after the prompt: generated (mask 1) and inserted (mask 0)."""

    prompt_ids: list[int]
    response_ids: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)  # 0.0 on inserted tokens
    versions: list[int] = dataclasses.field(default_factory=list)  # -1 on inserted tokens
    turns: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # tool calls and results, for the record

    def add_generated(self, ids: list[int], logprobs: list[float], versions: list[int]) -> None:
        if not len(ids) == len(logprobs) == len(versions):
            raise ValueError(f"{len(ids)} tokens need as many log-probs ({len(logprobs)}) and versions "
                             f"({len(versions)})")
        self.response_ids += ids
        self.loss_mask += [1] * len(ids)
        self.logprobs += logprobs
        self.versions += versions

    def add_inserted(self, ids: list[int]) -> None:
        self.response_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)


def turn_text(tokenizer: Any, ids: list[int]) -> str:
    """A turn's text, to be read (for tool calls, for a reply's content), never re-encoded. Special tokens
    stay: a tokenizer may mark ``<tool_call>`` special; only the end-of-turn token is dropped."""
    return tokenizer.decode(ids[:-1] if ids and ids[-1] == tokenizer.eos_token_id else ids)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The calls in a Qwen3-format turn: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks."""
    calls = []
    for body in _TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                raise ValueError("a tool call is a JSON object with a \"name\" string")
            arguments = call.get("arguments", {})
            if isinstance(arguments, str):  # some models send the arguments JSON-encoded
                arguments = json.loads(arguments)
            if not isinstance(arguments, dict):
                raise ValueError("\"arguments\" must be a JSON object")
            calls.append(ToolCall(call["name"], arguments))
        except ValueError as err:  # json.JSONDecodeError is a ValueError
            calls.append(ToolCall("", {}, error=f"could not read the tool call {body[:200]!r}: {err}"))
    return calls


def tool_messages(results: list[str]) -> list[dict[str, str]]:
    """Tool results as the chat messages that carry them."""
    return [{"role": "tool", "content": result} for result in results]


def turn_ids(tokenizer: Any, messages: list[dict[str, Any]], *, ended_with_eos: bool,
             thinking: bool = True) -> list[int]:
    """The tokens to insert after an assistant turn: its closing, ``messages`` (tool results, or a user's
    next message), and the prompt for the next assistant turn -- as the tokenizer's chat template writes them."""
    first, second = (_render(tokenizer, [{"role": "user", "content": "probe"}, {"role": "assistant", "content": answer},
                                         *messages], thinking) for answer in ("1", "2"))
    common = next(k for k in range(min(len(first), len(second)) + 1)
                  if k == min(len(first), len(second)) or first[-k - 1] != second[-k - 1])
    tail = first[len(first) - common:]
    if not tail or tail[0] != tokenizer.eos_token_id:
        raise ValueError("the chat template does not close an assistant turn with the tokenizer's EOS token; "
                         "its tool turns cannot be inserted token by token")
    return tail[1:] if ended_with_eos else tail


def _render(tokenizer: Any, messages: list[dict[str, Any]], thinking: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=thinking)
    return list(ids if isinstance(ids, list) else ids["input_ids"])
