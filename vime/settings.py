"""One setting of a run: its default, what it means and the values it takes, declared together.

Every dataclass field that becomes a command-line flag is declared with
:func:`setting`, so ``--help`` can show each flag's meaning next to its
default without a second list that could drift. A field typed
``Literal[...]`` takes only those values: argparse offers them as its
choices, and :func:`check_choices` refuses any other, with the same list,
for a setting given in code or read back from config.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import types
import typing
from typing import Any


def setting(default: Any, help: str, flags: tuple[str, ...] = (), *, metavar: str | None = None,
            const: Any = dataclasses.MISSING, spellings: dict[str, Any] | None = None) -> Any:
    """A dataclass field with ``default`` whose ``--help`` text is ``help`` (a dict default is copied
    for each instance; ``dataclasses.MISSING``: a field without default, which code must give).
    ``flags``: the command line's spellings of it, when not just ``--field-name`` (an alias kept for an
    older name, with the field itself the one source of truth); ``metavar``: the value's name in --help;
    ``const``: what the flag given without a value means (``--exit-with-parent`` alone); ``spellings``: other
    names of a choice on the command line, read as the choice they name (slime's ``--tis-level geometric``)."""
    metadata = {"help": help, "flags": flags, "metavar": metavar, "const": const, "spellings": spellings or {}}
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


def add_setting_flags(group: Any, kind: type, defaults: Any = None) -> None:
    """One ``--flag`` per field of the settings class ``kind``, on an argparse parser or group. Every flag
    defaults to None, so that what was not given is known (:func:`given_settings`) and the class's default,
    or ``defaults``' value (shown in --help), stands. A ``dict`` field is free-form ``--PREFIX-NAME VALUE``
    flags, which the caller picks out of the command line itself (``vime.config.engine_flags``)."""
    hints = hints_of(kind)
    for field in dataclasses.fields(kind):
        name, annotation = field.name, hints[field.name]
        flags, meta = flags_of(field), field.metadata
        default = getattr(defaults, name) if defaults is not None else _default_of(field)
        shown = "" if default is dataclasses.MISSING else f" (default: {default!r})"
        help_text = f"{help_of(field)}{shown}".replace("%", "%%")
        if typing.get_origin(annotation) is dict:
            group.add_argument(f"--{flag_prefix(name)}-NAME", metavar="VALUE",
                               dest=f"_{name}_help", help=help_text)
        elif annotation is bool:
            group.add_argument(*flags, dest=name, action=_Switch, default=None, help=help_text)
        elif typing.get_origin(annotation) is tuple:
            item = typing.get_args(annotation)[0]
            group.add_argument(*flags, dest=name, action=_Store, type=item, nargs="*", default=None,
                               metavar=meta.get("metavar") or ("ID" if item is int else "VALUE"), help=help_text)
        elif choices_of(annotation):
            spellings = meta.get("spellings") or {}
            group.add_argument(*flags, dest=name, action=_Store, choices=choices_of(annotation), default=None,
                               type=lambda value, spellings=spellings: spellings.get(value, value), help=help_text)
        else:
            optional = {} if meta.get("const", dataclasses.MISSING) is dataclasses.MISSING else {
                "nargs": "?", "const": meta["const"]}
            group.add_argument(*flags, dest=name, action=_Store, type=_scalar(annotation), default=None,
                               metavar=meta.get("metavar"), help=help_text, **optional)


def flag_prefix(name: str) -> str:
    """The prefix of a dict field's free-form flags: ``vllm_args`` -> ``vllm`` (``--vllm-NAME VALUE``)."""
    return name.removesuffix("_args").replace("_", "-")


def flag_values(tokens: list[str], index: int) -> tuple[str, list[str], int]:
    """The flag at ``tokens[index]`` of a command line argparse does not read (``--vllm-*``, ``--sglang-*``), its
    values and the index after them: ``--flag=value``, or the tokens up to the next ``--flag`` (none: a switch;
    several: a list, as ``--sglang-cuda-graph-bs 1 2 4``)."""
    flag, _, value = tokens[index].partition("=")
    index += 1
    values = [value] if value else []
    while not value and index < len(tokens) and not tokens[index].startswith("--"):
        values.append(tokens[index])
        index += 1
    return flag, values, index


def given_settings(args: argparse.Namespace, kind: type) -> dict[str, Any]:
    """The fields of ``kind`` whose flags were given (lists as tuples, as the fields hold them)."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(kind) if getattr(args, f.name, None) is not None}
    return {name: tuple(value) if isinstance(value, list) else value for name, value in given.items()}


def spelling_of(args: argparse.Namespace, name: str) -> str | None:
    """The flag the command line set field ``name`` with (``--eps-clip`` or ``--clip-low``: one setting, two
    spellings), or None when it was not given. For a translation that depends on the name a user knows it by."""
    return vars(args).get(_SPELLINGS, {}).get(name)


_SPELLINGS = "_flags_as_spelled"  # the Namespace attribute where the actions below note the flag they were given as


def _remember(namespace: argparse.Namespace, dest: str, option_string: str | None) -> None:
    vars(namespace).setdefault(_SPELLINGS, {})[dest] = option_string


class _Store(argparse.Action):
    """argparse's store, noting which of the setting's flags was used."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        _remember(namespace, self.dest, option_string)


class _Switch(argparse.BooleanOptionalAction):
    """``--flag`` / ``--no-flag``, noting which of the setting's flags was used."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        super().__call__(parser, namespace, values, option_string)
        _remember(namespace, self.dest, option_string)


def _default_of(field: dataclasses.Field) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def _scalar(annotation: Any) -> type:
    """The type argparse converts a value to: ``int | None`` reads an int."""
    if isinstance(annotation, types.UnionType):
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    return annotation
