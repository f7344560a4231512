"""The tools of a run: their schemas for the chat template, and each call run in the sandbox.

A tool is a function named ``module:function`` (``--tool``). Its schema --
what the chat template shows the model -- is the function's ``schema``
attribute when it has one (an OpenAI-style ``{"type": "function", ...}``),
else it is built from the signature and docstring by transformers'
``get_json_schema`` (type hints and a Google-style ``Args:`` section). The
call itself never runs in the caller: :func:`vime.agent.sandbox.run` gives
it a fresh confined process, and whatever goes wrong is text for the model.

:class:`ToolUse` is a rollout worker's side of tools (``--tool``): a turn
that stops with tool calls has them run in the sandbox (in threads, so
generation goes on), their results inserted into the episode as tool
messages (loss mask 0), and the response goes on with its next turn; the
group is scored once every response has ended.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

import trio

from vime.agent import sandbox
from vime.agent.episode import Episode, ToolCall, parse_tool_calls, tool_messages, turn_ids, turn_text
from vime.plugins import import_function

if TYPE_CHECKING:
    from vime.backends.base import SamplingParams, Sequence
    from vime.config import AgentConfig


class Toolbox:
    def __init__(self, specs: tuple[str, ...] | list[str], limits: sandbox.Limits = sandbox.Limits()) -> None:
        """Import each tool once, here, for its schema; a ValueError names a tool that cannot serve."""
        self.limits = limits
        self.functions: dict[str, str] = {}  # the name the model calls -> module:function
        self.schemas: list[dict[str, Any]] = []
        for spec in specs:
            schema = schema_of(import_function(spec, "--tool"), spec)
            name = schema["function"]["name"]
            if name in self.functions:
                raise ValueError(f"--tool {spec}: a tool named {name!r} is already given ({self.functions[name]})")
            self.functions[name] = spec
            self.schemas.append(schema)

    def call(self, call: ToolCall) -> str:
        """The text the model is shown for one call: the result, or what went wrong."""
        if call.error:
            return call.error
        spec = self.functions.get(call.name)
        if spec is None:
            return f"there is no tool named {call.name!r}; the tools are {', '.join(sorted(self.functions))}"
        return sandbox.run(spec, call.arguments, self.limits).output


class ToolUse:
    """The tools of a rollout worker's episodes: the calls a turn makes, running them, and the next turn's
    sampling. Read with the worker's ``tokenizer``; ``thinking`` as the chat template renders turns."""

    def __init__(self, agent: AgentConfig, tokenizer: Any, thinking: bool) -> None:
        self.agent, self.tokenizer, self.thinking = agent, tokenizer, thinking
        limits = sandbox.Limits(seconds=agent.tool_timeout_s, memory_mb=agent.tool_memory_mb)
        self.toolbox = Toolbox(agent.tool, limits) if agent.tool else None
        self.limiter = trio.CapacityLimiter(os.cpu_count() or 1)  # each call is a process of its own

    def calls(self, episode: Episode, turn: Sequence) -> list[ToolCall]:
        """The calls a turn makes, if the response may go on: it stopped (was not cut), within the limits.
        Its text is decoded only to be read; the tokens stay the engine's."""
        agent = self.agent
        if (self.toolbox is None or turn.finish_reason != "stop"
                or len(episode.turns) >= agent.max_turns or len(episode.response_ids) >= agent.max_response_tokens):
            return []
        return parse_tool_calls(turn_text(self.tokenizer, turn.response_ids))

    async def run(self, calls: list[ToolCall]) -> list[str]:
        """Each call's result (or what went wrong), each run in the sandbox, in a thread."""
        assert self.toolbox is not None
        return [await trio.to_thread.run_sync(self.toolbox.call, call, limiter=self.limiter) for call in calls]

    def go_on(self, episode: Episode, turn: Sequence, calls: list[ToolCall],
              results: list[str]) -> SamplingParams | None:
        """Insert the results as the chat template writes tool messages; the sampling of the response's next
        turn, or None when the response is at its token limit (it ends)."""
        episode.add_inserted(turn_ids(self.tokenizer, tool_messages(results), thinking=self.thinking,
                                      ended_with_eos=turn.response_ids[-1] == self.tokenizer.eos_token_id))
        episode.turns.append({"calls": [dataclasses.asdict(call) for call in calls], "results": results})
        room = self.agent.max_response_tokens - len(episode.response_ids)
        if room <= 0:
            return None
        return dataclasses.replace(turn.params, max_new_tokens=min(turn.params.max_new_tokens, room))


def schema_of(function: Any, spec: str) -> dict[str, Any]:
    """The function's OpenAI-style schema (see the module's docstring); a ValueError says what to add."""
    schema = getattr(function, "schema", None)
    if schema is None:
        from transformers.utils import get_json_schema

        try:
            schema = get_json_schema(function)
        except Exception as err:  # transformers raises its own error types for each missing piece
            raise ValueError(f"--tool {spec}: no schema ({err}); give the function a `schema` attribute or type "
                             "hints and a docstring with an Args: section") from None
    if not (isinstance(schema, dict) and schema.get("type") == "function"
            and isinstance(schema.get("function", {}).get("name"), str)):
        raise ValueError(f"--tool {spec}: its schema must look like {{\"type\": \"function\", \"function\": "
                         "{\"name\": ..., \"parameters\": ...}}")
    return schema
