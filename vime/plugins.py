"""User code named on our own command line as ``package.module:name``.

Only flags and config written by the user reach this: nothing received over
the wire decides what is imported.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable


def import_function(spec: str, flag: str) -> Callable[..., Any]:
    """The callable ``spec`` names, or a ValueError that says what ``flag`` expects."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{flag} {spec!r}: expected package.module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{flag} {spec!r}: cannot import {module_name} ({err}); is it on PYTHONPATH?") from err
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{flag} {spec!r}: {module_name} has no function {attr!r}")
    return fn
