"""One setting of a run: its default, what it means and the values it takes, declared together.

Every dataclass field that becomes a command-line flag is declared with
:func:`setting`, so ``--help`` can show each flag's meaning next to its
default without a second list that could drift. A field typed
``Literal[...]`` takes only those values: argparse offers them as its
choices, and :func:`check_choices` refuses any other, with the same list,
for a setting given in code or read back from config.json.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any


def setting(default: Any, help: str, flags: tuple[str, ...] = ()) -> Any:
    """A dataclass field with ``default`` whose ``--help`` text is ``help`` (a dict default is copied
    for each instance). ``flags``: the command line's spellings of it, when not just ``--field-name``
    (an alias kept for an older name, with the field itself the one source of truth)."""
    metadata = {"help": help, "flags": flags} if flags else {"help": help}
    if isinstance(default, dict):
        return dataclasses.field(default_factory=lambda: dict(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def help_of(field: dataclasses.Field) -> str:
    """The meaning a field was declared with ("" for one declared without)."""
    return field.metadata.get("help", "")


def flags_of(field: dataclasses.Field) -> tuple[str, ...]:
    """The command-line flags that set a field: ``--field-name`` unless it was declared with others."""
    return field.metadata.get("flags") or ("--" + field.name.replace("_", "-"),)


def choices_of(annotation: Any) -> tuple[Any, ...]:
    """The values a ``Literal[...]`` annotation allows; () for any other type."""
    return typing.get_args(annotation) if typing.get_origin(annotation) is typing.Literal else ()


@functools.cache
def hints_of(kind: type) -> dict[str, Any]:
    """A settings class's field types, resolved once (modules use ``from __future__ import annotations``)."""
    return typing.get_type_hints(kind)


def check_choices(settings: Any) -> None:
    """ValueError naming the flag of the first field whose value its ``Literal`` type does not allow.
    argparse checks the flags; this checks what is set in code (a scenario's defaults, ``replace``) or
    read back from a config.json, with the same list of values."""
    hints = hints_of(type(settings))
    for field in dataclasses.fields(settings):
        allowed, value = choices_of(hints[field.name]), getattr(settings, field.name)
        if allowed and value not in allowed:
            flags = flags_of(field)
            named = flags[0] + "".join(f" (or {flag})" for flag in flags[1:])
            raise ValueError(f"{named} must be one of {', '.join(map(str, allowed))}, not {value!r}")
