"""Built-in rewards, and how user rewards are found and called.

A reward function is ``fn(response: str, label: str, **metadata) -> float``,
plain or ``async``. Built-ins are plain functions of this module, callable as
``vime.rewards.NAME(response, label)`` and chosen with ``--reward NAME``; a
user's is given as ``--custom-reward package.module:function``, or, written as
slime's ``custom_rm(args, sample)``, as ``--custom-rm-path`` (``vime.slime_reward``).
Where they run, and under which time limit: ``vime.reward_workers``.
"""

from __future__ import annotations

import decimal
import inspect
import math as _math
import re
import threading
from typing import Any, Awaitable, Callable

from vime import slime_reward
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


_GSM8K_NUMBER = re.compile(r"[-\u2212]?(?:\d[\d,]*(?:\.\d+)?|\.\d+)")
_CURRENCY = re.compile(r"\\?[$\u20ac\u00a3\u00a5]|\\%|%")
_FRACTION = re.compile(r"\\d?frac\{\s*(-?\d+(?:\.\d+)?)\s*\}\{\s*(\d+(?:\.\d+)?)\s*\}")


def gsm8k(response: str, label: str, **metadata: Any) -> float:
    """1.0 when the response's final answer equals GSM8K's reference answer.

    The reference is what follows "####" in the label (the whole label when
    there is none). The response's answer is, by priority, the first number
    after its last "####", the number in its last ``\\boxed{}`` (which may be
    a ``\\frac``), or its last number. Numbers compare as decimals, so commas, currency signs, a percent
    sign and trailing zeros do not matter: "$1,000.00" equals "1000".
    """
    reference = _gsm8k_number(label.rpartition("####")[2] if "####" in label else label)
    answer = _final_number(response)
    return 1.0 if reference is not None and answer is not None and answer == reference else 0.0


def _final_number(response: str) -> decimal.Decimal | None:
    if "####" in response:
        return _gsm8k_number(response.rpartition("####")[2], first=True)
    boxed = _last_boxed(response)
    if boxed is not None:
        return _gsm8k_number(_FRACTION.sub(_divide, boxed))
    return _gsm8k_number(response)


def _divide(fraction: re.Match) -> str:
    """``\\frac{15}{2}`` -> ``7.5``, for a boxed answer written as a fraction."""
    numerator, denominator = (decimal.Decimal(part) for part in fraction.groups())
    return str(numerator / denominator) if denominator else fraction.group()


def _gsm8k_number(text: str, first: bool = False) -> decimal.Decimal | None:
    """The first (or last) number in ``text`` as a Decimal, signs and separators dropped."""
    found = _GSM8K_NUMBER.findall(_CURRENCY.sub("", text))
    if not found:
        return None
    digits = (found[0] if first else found[-1]).replace(",", "").replace("\u2212", "-")
    try:
        return decimal.Decimal(digits).normalize()
    except decimal.InvalidOperation:
        return None


def _last_boxed(text: str) -> str | None:
    """The contents of the last ``\\boxed{...}``, nested braces included; None when there is none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for index in range(begin - 1, len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth == 0:
            return text[begin:index]
    return None


def math(response: str, label: str, **metadata: Any) -> float:
    """1.0 when the response's answer is mathematically equal to the label, checked by math-verify.

    The label is a LaTeX or plain expression (``\\frac{1}{2}``, ``34``,
    ``(1,2)``); the response's answer is found by math-verify (a ``\\boxed{}``,
    an "Answer:" line, or the last expression) and compared symbolically --
    ``0.5`` equals ``\\frac{1}{2}`` and ``1+x^2`` equals ``x^2+1``. math-verify
    stops a slow comparison after 5 s with ``signal.alarm``, which only the
    main thread can use; called from another thread, it runs without that limit.
    """
    from math_verify import parse, verify

    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(label if "$" in label or "\\boxed" in label else f"${label}$", parsing_timeout=timeout)
    answer = parse(response, parsing_timeout=timeout)
    if not gold or not answer:
        return 0.0
    if any(_too_large(expression) for expression in answer):  # the same expression as the label's, or wrong
        return 1.0 if answer[-1] == gold[-1] else 0.0
    return 1.0 if verify(gold, answer, timeout_seconds=timeout) else 0.0


def deepscaler(response: str, label: str, **metadata: Any) -> float:
    """slime's ``deepscaler`` reward (``slime/rollout/rm_hub/deepscaler.py``), in what it reads: the solution is
    what follows the last ``</think>`` (else what follows the first ``###Response``; a response with neither scores
    0.0, its thinking never closed), and its answer is the last ``\\boxed{}`` in it only (an unboxed answer scores
    0.0); a label holding a ``\\boxed{}`` is compared by its contents, an empty label scores 0.0. It departs from
    slime in how two answers are found equal: slime normalizes them as MATH's grader does and then compares them
    in sympy; vime compares the boxed answer with :func:`math` (math-verify), which takes at least as many forms of
    one number as equal (``0.5`` and ``\\frac{1}{2}``)."""
    if "</think>" in response:
        solution = response.split("</think>")[-1]
    elif "###Response" in response:
        solution = response.split("###Response")[1]
    else:
        return 0.0
    answer, label = _last_boxed(solution), str(label)
    if "\\boxed" in label:
        label = _last_boxed(label) or ""
    if answer is None or not label:
        return 0.0
    return math(f"\\boxed{{{answer}}}", label)


# An answer holding a power of more digits than this is compared as written, not evaluated: sympy spends
# math-verify's whole time limit (5 s) expanding ``9^{9^{9^{9}}}``, and one such answer in a hundred cut the
# reward's throughput tenfold and more (bench/rewards.py). No answer to a math problem is a number this long.
MAX_ANSWER_DIGITS = 10_000


def _too_large(expression: Any) -> bool:
    """Whether a parsed answer (a sympy expression; math-verify also returns the text) holds an integer power
    of more than MAX_ANSWER_DIGITS digits."""
    import sympy

    if not isinstance(expression, sympy.Basic):
        return False
    return any(_log10_size(power) > MAX_ANSWER_DIGITS for power in expression.atoms(sympy.Pow))


def _log10_size(expression: Any) -> float:
    """About log10 of |expression| for a number or a tower of powers of numbers, without computing it (inf
    past a float's range); 0 for anything else (a symbol, a negative exponent: small or not a number)."""
    if expression.is_Number:
        try:
            size = abs(float(expression))
        except OverflowError:
            return _math.inf
        return _math.log10(size) if size > 1 else 0.0
    if expression.is_Pow:
        base, exponent = expression.args
        if exponent.is_negative:
            return 0.0
        exponent_size = _log10_size(exponent)
        return _math.inf if exponent_size > 300 else 10 ** exponent_size * _log10_size(base)
    return 0.0


def _same_number(text: str, label: str) -> bool:
    try:
        return _math.isclose(float(text.replace(",", "")), float(label.replace(",", "").strip()), abs_tol=1e-9)
    except ValueError:
        return False


BUILT_IN: dict[str, RewardFn] = {"exact": exact, "first_number": first_number, "last_number": last_number,
                                  "gsm8k": gsm8k, "math": math, "deepscaler": deepscaler}


def resolve(name: str, custom: str = "", custom_rm_path: str = "",
            settings: dict[str, dict[str, Any]] | None = None) -> RewardFn:
    """The reward to use: ``custom_rm_path`` (slime's ``custom_rm(args, sample)``, given the ``args`` of the run's
    ``settings``: ``vime.slime_reward``) or ``custom`` (module:function) when given, else the built-in ``name``."""
    if custom_rm_path:
        return slime_reward.load(custom_rm_path, settings)
    if custom:
        fn = import_function(custom, "--custom-reward")
        if slime_reward.parameters(fn)[:2] == ["args", "sample"]:
            raise ValueError(f"--custom-reward {custom}: {getattr(fn, '__qualname__', fn)} takes (args, sample), "
                             f"slime's signature: pass it as --custom-rm-path {custom}, or write it as "
                             "fn(response, label, **metadata)")
        return fn
    if name not in BUILT_IN:
        raise ValueError(f"--reward {name!r} is not a built-in reward; choose one of {sorted(BUILT_IN)} "
                         "or pass --custom-reward package.module:function")
    return BUILT_IN[name]


def call(fn: RewardFn, response: str, label: str, metadata: dict[str, Any],
         sample_fields: dict[str, Any] | None = None) -> Any:
    """``fn``'s value for one response, a coroutine for an async ``fn``: vime's reward functions take ``(response,
    label, **metadata)``; slime's (``--custom-rm-path``) a sample built from these and ``sample_fields``
    (``vime.slime_reward.sample_fields``; None where there is no rollout sample)."""
    if isinstance(fn, slime_reward.SlimeReward):
        return fn(response, label, metadata, sample_fields or {})
    return fn(response, label, **metadata)


def is_async(fn: RewardFn) -> bool:
    """Whether calling ``fn`` gives a coroutine (an async function, or an object with an async ``__call__``)."""
    target = fn.function if isinstance(fn, slime_reward.SlimeReward) else fn
    return inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(getattr(target, "__call__", None))


async def score(fn: RewardFn, response: str, label: str, metadata: dict[str, Any],
                sample_fields: dict[str, Any] | None = None) -> float:
    """Call a reward function (plain or async; see :func:`call`) and check that it returned a finite number."""
    value = call(fn, response, label, metadata, sample_fields)
    if inspect.isawaitable(value):
        value = await value
    return checked(fn, value)


def checked(fn: RewardFn, value: Any) -> float:
    """``value`` as a float, if it is a finite number (a bool is not); else TypeError naming ``fn``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _math.isfinite(value):
        # slime takes a dict and picks the reward with --reward-key, which vime has not
        hint = ": return the reward itself, not a dict of rewards" if isinstance(value, dict) else ""
        raise TypeError(f"reward function {getattr(fn, '__qualname__', fn)!r} returned {value!r}; "
                        f"it must return a finite float{hint}")
    return float(value)


def check_contract(fn: RewardFn) -> None:
    """Check that ``fn`` can serve as a reward, calling it as the reward actor does.

    Raises TypeError saying what is wrong: it must take ``(response, label,
    **metadata)`` and return a finite float (directly or from a coroutine).
    Users can run this on their function before starting a job; a slime
    ``custom_rm(args, sample)`` is checked as
    ``check_contract(vime.slime_reward.load("package.module.custom_rm"))``.
    """
    if not isinstance(fn, slime_reward.SlimeReward):  # load() checked a slime function's (args, sample)
        try:
            inspect.signature(fn).bind("response", "label", source="check_contract")
        except TypeError as err:
            raise TypeError(f"reward function {getattr(fn, '__qualname__', fn)!r} must accept "
                            f"(response: str, label: str, **metadata): {err}") from None
    import trio

    trio.run(score, fn, "7", "7", {"source": "check_contract"})
