"""A calculator over a safe expression parser: Python's own parser reads the expression into a
syntax tree, and this module evaluates only numbers, arithmetic and a few math functions from it.
Nothing is ever passed to eval; names, attributes, subscripts and everything else are refused, and
sizes are bounded so `9**9**9` cannot stall the server."""
from __future__ import annotations

import ast
import math
import operator

from chatloom.app.generation.tool_calls import ToolSpec
from chatloom.app.tools.registry import Tool, ToolContext, ToolFailure

MAX_CHARS = 200
MAX_EXPONENT = 1000
MAX_MAGNITUDE = 1e300

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS = {"sqrt": math.sqrt, "sin": math.sin, "cos": math.cos, "tan": math.tan, "log": math.log,
              "log10": math.log10, "exp": math.exp, "abs": abs, "round": round, "min": min, "max": max,
              "floor": math.floor, "ceil": math.ceil}
_CONSTANTS = {"pi": math.pi, "e": math.e}


def evaluate(expression: str) -> float | int:
    """The value of an arithmetic expression; ToolFailure naming what is not allowed."""
    if len(expression) > MAX_CHARS:
        raise ToolFailure(f"the expression is too long (at most {MAX_CHARS} characters)")
    try:
        tree = ast.parse(expression.replace("^", "**"), mode="eval")
    except SyntaxError:
        raise ToolFailure(f"cannot read {expression!r} as arithmetic") from None
    try:
        return _eval(tree.body)
    except ZeroDivisionError:
        raise ToolFailure("division by zero") from None
    except (OverflowError, ValueError) as exc:
        raise ToolFailure(f"cannot compute: {exc}") from None


def _eval(node: ast.AST) -> float | int:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:
        return _CONSTANTS[node.id]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ToolFailure(f"exponents are limited to {MAX_EXPONENT}")
        result = _BINARY[type(node.op)](left, right)
        if isinstance(result, complex) or abs(result) > MAX_MAGNITUDE:
            raise ToolFailure("the result is out of range")
        return result
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS
            and not node.keywords and len(node.args) <= 4):
        return _FUNCTIONS[node.func.id](*(_eval(a) for a in node.args))
    raise ToolFailure(f"not allowed in a calculation: {ast.unparse(node)[:40]!r}")


def format_number(value: float | int) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(round(value, 12)) if isinstance(value, float) else str(value)


async def _run(args: dict, ctx: ToolContext) -> str:
    return format_number(evaluate(args["expression"]))


TOOL = Tool(ToolSpec("calculator", "Evaluate an arithmetic expression exactly, e.g. (17 * 23) + sqrt(2).",
                     {"type": "object", "properties": {"expression": {"type": "string"}},
                      "required": ["expression"], "additionalProperties": False}), _run)
