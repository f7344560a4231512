"""User code named on our own command line as ``package.module:name``.

Only flags and config written by the user reach this: nothing received over
the wire decides what is imported.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable


def import_function(spec: str, flag: str, *, dotted: bool = False) -> Callable[..., Any]:
    """The callable ``spec`` names, or a ValueError that says what ``flag`` expects. ``dotted``: a spec without a
    colon names its function after the last dot (slime's ``package.module.function``)."""
    module_name, _, attr = spec.rpartition(".") if dotted and ":" not in spec else spec.partition(":")
    if not module_name or not attr:
        expected = "package.module.function (or package.module:function)" if dotted else "package.module:function"
        raise ValueError(f"{flag} {spec!r}: expected {expected}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{flag} {spec!r}: cannot import {module_name} ({err}); is it on PYTHONPATH?") from err
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{flag} {spec!r}: {module_name} has no function {attr!r}")
    return fn
