"""One setting of a run: its default and what it means, declared together.

Every dataclass field that becomes a ``python -m vime.scenario`` flag is
declared with :func:`setting`, so ``--help`` can show each flag's meaning
next to its default without a second list that could drift.
"""

from __future__ import annotations

import dataclasses
from typing import Any


def setting(default: Any, help: str) -> Any:
    """A dataclass field with ``default`` whose ``--help`` text is ``help`` (a dict default is copied
    for each instance)."""
    if isinstance(default, dict):
        return dataclasses.field(default_factory=lambda: dict(default), metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


def help_of(field: dataclasses.Field) -> str:
    """The meaning a field was declared with ("" for one declared without)."""
    return field.metadata.get("help", "")
