"""The built-in calculator tool: arithmetic on numbers, with the functions of ``math`` a model reaches for.

The expression is parsed (``ast``), never executed: only numbers, the
arithmetic operators, a few named constants and whitelisted functions are
accepted, and anything else is an error that says what is allowed. It still
runs in the sandbox like every tool, since ``9**9**9**9`` alone would take a
process down.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any, Callable

_OPERATORS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
    ast.USub: operator.neg, ast.UAdd: operator.pos,
}
_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "sqrt": math.sqrt, "log": math.log, "log10": math.log10, "exp": math.exp, "sin": math.sin, "cos": math.cos,
    "tan": math.tan, "floor": math.floor, "ceil": math.ceil, "abs": abs, "round": round, "min": min, "max": max,
}
_CONSTANTS = {"pi": math.pi, "e": math.e}


SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression, e.g. '(16 - 3 - 4) * 2' or 'sqrt(2) ** 2'. Operators: "
                       f"+ - * / // % **; functions: {', '.join(sorted(_FUNCTIONS))}; constants: pi, e.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}


def calculator(expression: str) -> str:
    """The value of ``expression`` as text (integers exactly, floats as Python prints them)."""
    try:
        tree = ast.parse(expression.replace("^", "**"), mode="eval")
    except SyntaxError as err:
        raise ValueError(f"not an arithmetic expression ({err.msg}): {expression!r}") from None
    return str(_value(tree.body))


calculator.schema = SCHEMA  # what --tool shows the model


def _value(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_value(node.operand))
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:
        return _CONSTANTS[node.id]
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS
            and not node.keywords):
        return _FUNCTIONS[node.func.id](*(_value(argument) for argument in node.args))
    raise ValueError(f"not allowed in a calculator expression: {ast.unparse(node)!r} (numbers, + - * / // % **, "
                     f"{', '.join(sorted(_FUNCTIONS))}, pi, e)")
