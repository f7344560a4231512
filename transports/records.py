"""Typed message records: declared once, validated on arrival.

A record is a dataclass registered with :func:`message`. Its class name is the
message *kind* on the wire, and its field annotations are the schema every
arriving payload is checked against before any handler sees it. Nothing here
knows about RL: the kinds themselves live beside the code that sends them.

A record may check what types cannot say (an address that must be dialable) in ``__post_init__``:
a ValueError it raises refuses the message like a schema error, and a sender building a bad record
learns of it at once.

Supported field types: ``int``, ``float``, ``str``, ``bytes``, ``bool``,
``Any``, ``torch.Tensor``, ``numpy.ndarray``, ``list[T]``, ``dict[str, T]``,
``T | None`` and other records (nested as maps). Deliberately absent: sets,
tuples, arbitrary classes -- anything msgpack cannot carry plainly.

Neither declaring a ``torch.Tensor`` field nor checking a record whose tensor
fields are None imports torch: the router and the reward actor handle such
records (a Sample's routed experts) and need no torch, whose import costs
each of them over a second of start-up. A module that declares one but uses
no torch itself imports it for type checkers only (``if TYPE_CHECKING``):
the schema reads ``torch.Tensor`` without it.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from typing import Any, Callable

import numpy as np

_KINDS: dict[str, type] = {}
_RECORDS: set[type] = set()


class SchemaError(ValueError):
    """A payload does not match the schema of its kind."""

    def __init__(self, problem: str, path: str = "") -> None:
        super().__init__(f"{path}: {problem}" if path else problem)
        self.problem = problem
        self.path = path

    def under(self, step: str) -> SchemaError:
        """The same error one level further out (paths are built only when something fails)."""
        dot = "." if self.path and not self.path.startswith("[") else ""
        return SchemaError(self.problem, f"{step}{dot}{self.path}")


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


def is_tensor(value: Any) -> bool:
    """Whether ``value`` is a torch tensor; asking never imports torch (a process that has not holds none)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def to_fields(record: Any) -> dict[str, Any]:
    """The record's fields as a map, the form it takes on the wire."""
    return {f: getattr(record, f) for f in record.__dataclass_fields__}


def build(record_type: type, fields: Any) -> Any:
    """Check a decoded map against ``record_type``'s schema and construct it."""
    validate = record_type.__vime_validate__
    if validate is None:
        validate = record_type.__vime_validate__ = _compile_record(record_type)
    try:
        return validate(fields)
    except SchemaError as err:
        raise err.under(record_type.__name__) from None


Check = Callable[[Any], Any]


class _Tensor:
    """``torch.Tensor`` in a record's string annotation, as its schema reads it (the name ``torch`` is not
    looked up in the declaring module): a value is checked against the real class when one arrives."""


_ANNOTATION_NAMES = {"torch": types.SimpleNamespace(Tensor=_Tensor)}


def _compile_record(record_type: type) -> Check:
    hints = typing.get_type_hints(record_type, localns={**vars(record_type), **_ANNOTATION_NAMES})
    fields = dataclasses.fields(record_type)
    checks = {f.name: _compile(hints[f.name]) for f in fields}
    required = {
        f.name
        for f in fields
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }

    def validate(value: Any) -> Any:
        if type(value) is not dict:
            raise SchemaError(f"expected a map of fields, got {type(value).__name__}")
        if not value.keys() <= checks.keys():
            raise SchemaError(f"unknown field(s) {sorted(map(str, value.keys() - checks.keys()))}")
        if not required <= value.keys():
            raise SchemaError(f"missing field(s) {sorted(required - value.keys())}")
        converted = {}
        for key, item in value.items():
            try:
                converted[key] = checks[key](item)
            except SchemaError as err:
                raise err.under(key) from None
        try:
            return record_type(**converted)
        except ValueError as err:  # the record's own __post_init__ refused a value its types allow
            raise SchemaError(str(err)) from None

    return validate


def _compile(tp: Any) -> Check:
    """A checker for one annotation: returns the (possibly converted) value or raises."""
    if tp is Any:
        return _accept_any
    if tp in _RECORDS:
        return lambda v: v if type(v) is tp else build(tp, v)
    if tp is float:
        return _check_float
    if _is_tensor_type(tp):
        return _check_tensor
    if tp in _SCALARS or tp is np.ndarray:
        return _type_check(tp, exact=tp in _SCALARS)
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return _union_check([_compile(a) for a in args if a is not type(None)], type(None) in args)
    if origin is list:
        element = args[0] if args else Any
        return _list_check(_compile(element), element if element in _SCALARS or element is float else None)
    if origin is dict:
        return _dict_check(*((_compile(a) for a in args) if args else (_accept_any, _accept_any)))
    raise TypeError(f"field type {tp!r} cannot travel in a message; use one of: {__doc__}")


_SCALARS = {int, str, bytes, bool, type(None)}


def _accept_any(value: Any) -> Any:
    return value


def _type_check(tp: type, exact: bool) -> Check:
    def check(value: Any) -> Any:
        # Scalars match exactly: bool is an int subclass, and a flag where a count is expected is a bug.
        if type(value) is not tp and (exact or not isinstance(value, tp)):
            raise SchemaError(f"expected {tp.__name__}, got {type(value).__name__}")
        return value

    return check


def _is_tensor_type(tp: Any) -> bool:
    """Whether an annotation means ``torch.Tensor``: read from a string, or the class itself (a module without
    ``from __future__ import annotations``, which imported torch)."""
    torch = sys.modules.get("torch")
    return tp is _Tensor or (torch is not None and tp is torch.Tensor)


def _check_tensor(value: Any) -> Any:
    if not is_tensor(value):
        raise SchemaError(f"expected Tensor, got {type(value).__name__}")
    return value


def _check_float(value: Any) -> float:
    # msgpack writes 1.0 as a float but users write 1; accept ints, never bools.
    if type(value) is float:
        return value
    if type(value) is int:
        return float(value)
    raise SchemaError(f"expected float, got {type(value).__name__}")


def _list_check(item: Check, scalar: type | None) -> Check:
    """``scalar``: the element type when it is a plain scalar; a list made only of
    exactly that type (the common case: token ids, log-probs) passes in one sweep."""

    def check(value: Any) -> list:
        if type(value) is not list:
            raise SchemaError(f"expected list, got {type(value).__name__}")
        if item is _accept_any or (scalar is not None and all(type(element) is scalar for element in value)):
            return value
        out = []
        for index, element in enumerate(value):
            try:
                out.append(item(element))
            except SchemaError as err:
                raise err.under(f"[{index}]") from None
        return out

    return check


def _dict_check(key_check: Check, value_check: Check) -> Check:
    def check(value: Any) -> dict:
        if type(value) is not dict:
            raise SchemaError(f"expected dict, got {type(value).__name__}")
        out = {}
        for key, element in value.items():
            try:
                out[key_check(key)] = value_check(element)
            except SchemaError as err:
                raise err.under(f"[{key!r}]") from None
        return out

    return check


def _union_check(options: list[Check], nullable: bool) -> Check:
    def check(value: Any) -> Any:
        if value is None and nullable:
            return None
        problems = []
        for option in options:
            try:
                return option(value)
            except SchemaError as err:
                problems.append(str(err))
        raise SchemaError(" or ".join(problems) or f"expected None, got {type(value).__name__}")

    return check
