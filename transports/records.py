"""Typed message records: declared once, validated on arrival.

A record is a dataclass registered with :func:`message`. Its class name is the
message *kind* on the wire, and its field annotations are the schema every
arriving payload is checked against before any handler sees it. Nothing here
knows about RL: the kinds themselves live beside the code that sends them.

Supported field types: ``int``, ``float``, ``str``, ``bytes``, ``bool``,
``Any``, ``torch.Tensor``, ``numpy.ndarray``, ``list[T]``, ``dict[str, T]``,
``T | None`` and other records (nested as maps). Deliberately absent: sets,
tuples, arbitrary classes -- anything msgpack cannot carry plainly.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Callable

import numpy as np
import torch

_KINDS: dict[str, type] = {}
_RECORDS: set[type] = set()


class SchemaError(ValueError):
    """A payload does not match the schema of its kind."""


def message(cls: type | None = None, *, kind_name: bool = True) -> Any:
    """Declare a message record: a slotted dataclass whose class name is its kind.

    With ``kind_name=False`` the record can only travel nested inside another
    record (a sample inside a batch), never as a message of its own.
    """

    def wrap(klass: type) -> type:
        record = dataclasses.dataclass(slots=True)(klass)
        if kind_name:
            other = _KINDS.get(record.__name__)
            if other is not None and other.__module__ != record.__module__:
                raise TypeError(
                    f"message kind {record.__name__!r} is declared twice "
                    f"({other.__module__} and {record.__module__}); rename one"
                )
            _KINDS[record.__name__] = record
        _RECORDS.add(record)
        record.__vime_validate__ = None  # compiled lazily: annotations may be forward refs
        return record

    return wrap if cls is None else wrap(cls)


def kind_of(name: str) -> type:
    """The record class for a kind name; SchemaError when nobody declared it."""
    try:
        return _KINDS[name]
    except KeyError:
        raise SchemaError(f"unknown message kind {name!r}") from None


def is_record(obj: Any) -> bool:
    return type(obj) in _RECORDS


def to_fields(record: Any) -> dict[str, Any]:
    """The record's fields as a map, the form it takes on the wire."""
    return {f: getattr(record, f) for f in record.__dataclass_fields__}


def build(record_type: type, fields: Any) -> Any:
    """Check a decoded map against ``record_type``'s schema and construct it."""
    validate = record_type.__vime_validate__
    if validate is None:
        validate = record_type.__vime_validate__ = _compile_record(record_type)
    return validate(fields, record_type.__name__)


def _compile_record(record_type: type) -> Callable[[Any, str], Any]:
    hints = typing.get_type_hints(record_type)
    fields = dataclasses.fields(record_type)
    checks = {f.name: _compile(hints[f.name]) for f in fields}
    required = {
        f.name
        for f in fields
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }

    def validate(value: Any, where: str) -> Any:
        if not isinstance(value, dict):
            raise SchemaError(f"{where}: expected a map of fields, got {type(value).__name__}")
        unknown = value.keys() - checks.keys()
        if unknown:
            raise SchemaError(f"{where}: unknown field(s) {sorted(map(str, unknown))}")
        missing = required - value.keys()
        if missing:
            raise SchemaError(f"{where}: missing field(s) {sorted(missing)}")
        return record_type(**{k: checks[k](v, f"{where}.{k}") for k, v in value.items()})

    return validate


def _compile(tp: Any) -> Callable[[Any, str], Any]:
    """A checker for one annotation: returns the (possibly converted) value or raises."""
    if tp is Any:
        return lambda v, where: v
    if tp in _RECORDS:
        return lambda v, where: v if type(v) is tp else build(tp, v)
    if tp is float:
        return _check_float
    if tp in _SCALARS:
        return _scalar_check(tp)
    if tp is torch.Tensor or tp is np.ndarray:
        return _instance_check(tp)
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return _union_check([_compile(a) for a in args if a is not type(None)], type(None) in args)
    if origin is list:
        item = _compile(args[0]) if args else _compile(Any)
        return lambda v, where: [item(x, f"{where}[{i}]") for i, x in enumerate(_expect(v, list, where))]
    if origin is dict:
        key_check, value_check = (_compile(a) for a in args) if args else (_compile(Any),) * 2
        return lambda v, where: {
            key_check(k, f"{where} key"): value_check(x, f"{where}[{k!r}]")
            for k, x in _expect(v, dict, where).items()
        }
    raise TypeError(f"field type {tp!r} cannot travel in a message; use one of: {__doc__}")


_SCALARS = {int, str, bytes, bool, type(None)}


def _expect(value: Any, tp: type, where: str) -> Any:
    if not isinstance(value, tp):
        raise SchemaError(f"{where}: expected {tp.__name__}, got {type(value).__name__}")
    return value


def _scalar_check(tp: type) -> Callable[[Any, str], Any]:
    def check(value: Any, where: str) -> Any:
        # bool is an int subclass; a flag where a count is expected is a bug.
        if type(value) is not tp:
            raise SchemaError(f"{where}: expected {tp.__name__}, got {type(value).__name__}")
        return value

    return check


def _check_float(value: Any, where: str) -> float:
    # msgpack writes 1.0 as a float but users write 1; accept ints, never bools.
    if type(value) is float:
        return value
    if type(value) is int:
        return float(value)
    raise SchemaError(f"{where}: expected float, got {type(value).__name__}")


def _instance_check(tp: type) -> Callable[[Any, str], Any]:
    return lambda v, where: _expect(v, tp, where)


def _union_check(options: list[Callable[[Any, str], Any]], nullable: bool) -> Callable[[Any, str], Any]:
    def check(value: Any, where: str) -> Any:
        if value is None and nullable:
            return None
        errors = []
        for option in options:
            try:
                return option(value, where)
            except SchemaError as err:
                errors.append(str(err))
        raise SchemaError("; ".join(errors) or f"{where}: expected None")

    return check
