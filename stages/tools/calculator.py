"""CalculatorTool: arithmetic on ints and floats through `ast` (never eval), bounded in size and cost.

Accepted: numbers, + - * / // % ** (power), unary + and -, parentheses. `/` of two ints that divide evenly
stays an int (exact for big ints); a float result that is integral prints as an int ("7", not "7.0"), others
with 15 significant digits (0.1+0.2 -> "0.3"). Rejected with a ToolError: anything else (names, calls, ^),
expressions over MAX_CHARS, results beyond MAX_ABS in magnitude (checked before a power is computed, so
9**9**9 costs nothing), non-finite or complex results, division by zero.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any, ClassVar

from stages.tools.base import Tool, ToolError

MAX_CHARS = 200
MAX_ABS = 10**100
"""Largest result magnitude (ints and floats): bounds the digits of every intermediate result."""

BINARY_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
UNARY_OPS = {ast.USub: operator.neg, ast.UAdd: operator.pos}
HINT = "use numbers, + - * / // % ** (power) and parentheses"


class CalculatorTool(Tool):
    """Evaluates `arguments["expression"]`; the result as text ("123*45" -> "5535")."""

    CONFIG_KEYS: ClassVar[dict[str, Any]] = {**Tool.CONFIG_KEYS, "timeout_s": 5.0}

    async def call(self, arguments: dict[str, Any]) -> str:
        return calculate(str(arguments.get("expression", "")))


def calculate(expression: str) -> str:
    """The value of an arithmetic `expression` as text; ToolError saying what is wrong otherwise."""
    text = expression.strip()
    if not text:
        raise ToolError(f"empty expression; {HINT}")
    if len(text) > MAX_CHARS:
        raise ToolError(f"expression is {len(text)} characters, over the limit of {MAX_CHARS}")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ToolError(f"could not parse {text!r}; {HINT}") from None
    return _format(_eval(tree.body))


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY_OPS:
        return UNARY_OPS[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY_OPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        if isinstance(node.op, ast.Div) and isinstance(left, int) and isinstance(right, int) and right:
            if left % right == 0:
                return _bounded(left // right)  # exact for big ints, where float division would round
        try:
            return _bounded(BINARY_OPS[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:
            raise ToolError(f"result is too large (over 1e{len(str(MAX_ABS)) - 1})") from None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        raise ToolError("'^' is not a power here; write a**b")
    raise ToolError(f"unsupported element {ast.unparse(node)!r:.60}; {HINT}")


def _check_power(base: int | float, exponent: int | float) -> None:
    """ToolError when base**exponent would exceed MAX_ABS (estimated with logs, before computing it)."""
    if abs(base) > 1 and exponent > 0 and exponent * math.log10(abs(base)) > len(str(MAX_ABS)) - 1:
        raise ToolError(f"result of {base!r:.20}**{exponent!r:.20} is too large (over 1e{len(str(MAX_ABS)) - 1})")


def _bounded(value: Any) -> int | float:
    if isinstance(value, complex):
        raise ToolError("result is a complex number (a negative number to a fractional power)")
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("result is not a finite number")
    if abs(value) > MAX_ABS:
        raise ToolError(f"result is too large (over 1e{len(str(MAX_ABS)) - 1})")
    return value


def _format(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return str(value) if isinstance(value, int) else format(value, ".15g")
