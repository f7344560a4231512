"""Built-in rewards, and how user rewards are found and called.

A reward function is ``fn(response: str, label: str, **metadata) -> float``,
plain or ``async``. Built-ins are plain functions of this module, callable as
``vime.rewards.NAME(response, label)`` and chosen with ``--reward NAME``; a
user's is given as ``--custom-reward package.module:function``.
"""

from __future__ import annotations

import inspect
import math
import re
from typing import Any, Awaitable, Callable

from vime.plugins import import_function

RewardFn = Callable[..., "float | Awaitable[float]"]

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def exact(response: str, label: str, **metadata: Any) -> float:
    """1.0 when the response, stripped of surrounding whitespace, is exactly the label."""
    return 1.0 if response.strip() == label.strip() else 0.0


def first_number(response: str, label: str, **metadata: Any) -> float:
    """1.0 when the first number in the response equals the label numerically (commas ignored)."""
    found = _NUMBER.search(response)
    return 1.0 if found is not None and _same_number(found.group(), label) else 0.0


def last_number(response: str, label: str, **metadata: Any) -> float:
    """1.0 when the last number in the response equals the label numerically: the GSM8K habit."""
    found = _NUMBER.findall(response)
    return 1.0 if found and _same_number(found[-1], label) else 0.0


def _same_number(text: str, label: str) -> bool:
    try:
        return math.isclose(float(text.replace(",", "")), float(label.replace(",", "").strip()), abs_tol=1e-9)
    except ValueError:
        return False


BUILT_IN: dict[str, RewardFn] = {"exact": exact, "first_number": first_number, "last_number": last_number}


def resolve(name: str, custom: str = "") -> RewardFn:
    """The reward to use: ``custom`` (module:function) when given, else the built-in ``name``."""
    if custom:
        return import_function(custom, "--custom-reward")
    if name not in BUILT_IN:
        raise ValueError(f"--reward {name!r} is not a built-in reward; choose one of {sorted(BUILT_IN)} "
                         "or pass --custom-reward package.module:function")
    return BUILT_IN[name]


async def score(fn: RewardFn, response: str, label: str, metadata: dict[str, Any]) -> float:
    """Call a reward function (plain or async) and check that it returned a finite number."""
    value = fn(response, label, **metadata)
    if inspect.isawaitable(value):
        value = await value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"reward function {getattr(fn, '__qualname__', fn)!r} returned {value!r}; "
                        "it must return a finite float")
    return float(value)


def check_contract(fn: RewardFn) -> None:
    """Check that ``fn`` can serve as a reward, calling it as the reward actor does.

    Raises TypeError saying what is wrong: it must take ``(response, label,
    **metadata)`` and return a finite float (directly or from a coroutine).
    Users can run this on their function before starting a job.
    """
    try:
        inspect.signature(fn).bind("response", "label", source="check_contract")
    except TypeError as err:
        raise TypeError(f"reward function {getattr(fn, '__qualname__', fn)!r} must accept "
                        f"(response: str, label: str, **metadata): {err}") from None
    import trio

    trio.run(score, fn, "7", "7", {"source": "check_contract"})
