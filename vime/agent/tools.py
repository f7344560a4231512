"""The tools of a run: their schemas for the chat template, and each call run in the sandbox.

A tool is a function named ``module:function`` (``--tool``). Its schema --
what the chat template shows the model -- is the function's ``schema``
attribute when it has one (an OpenAI-style ``{"type": "function", ...}``),
else it is built from the signature and docstring by transformers'
``get_json_schema`` (type hints and a Google-style ``Args:`` section). The
call itself never runs in the caller: :func:`vime.agent.sandbox.run` gives
it a fresh confined process, and whatever goes wrong is text for the model.
"""

from __future__ import annotations

from typing import Any

from vime.agent import sandbox
from vime.agent.episode import ToolCall
from vime.plugins import import_function


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
