"""One setting of a run: its default and what it means, declared together.

Every dataclass field that becomes a ``python -m vime.scenario`` flag is
declared with :func:`setting`, so ``--help`` can show each flag's meaning
next to its default without a second list that could drift.
"""

from __future__ import annotations

import dataclasses
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
