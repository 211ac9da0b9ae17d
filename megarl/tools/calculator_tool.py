"""``CalculatorTool``: exact arithmetic on integers of any size (megarl's own; verl has none).

``execute({"expression": "123456789 * 987654321 + 5"})`` answers with the exact value:
integers with ``+ - * // % **``, parentheses and unary signs; ``/`` is exact division (a
fraction ``p/q`` in lowest terms unless it divides evenly). Evaluation walks the syntax tree of
those operations only (no names, calls or attributes: nothing else can run). A malformed
expression, a division by zero, a result of more than ``max_digits`` digits (config, 1000) or an
expression longer than ``max_expression_chars`` (config, 1000) answers ``Error: ...`` as the
tool's text; nothing raises. The step reward is 0.0: the task's score decides.
"""

from __future__ import annotations

import ast
import math
import operator
from fractions import Fraction
from typing import Any

from megarl.tools.base_tool import BaseTool
from megarl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

__all__ = ["DEFAULT_SCHEMA", "CalculatorError", "CalculatorTool", "evaluate"]

DEFAULT_SCHEMA = OpenAIFunctionToolSchema.model_validate(
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluates an arithmetic expression on integers exactly "
            "(+, -, *, /, //, %, ** and parentheses).",
            "parameters": {
                "type": "object",
                "properties": {
                    "expression": {
                        "type": "string",
                        "description": "The expression, e.g. 123456789 * 987654321",
                    }
                },
                "required": ["expression"],
            },
        },
    }
)
"""The schema used when the config gives none."""

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,  # on Fractions: exact
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_LOG2_10 = math.log2(10)


class CalculatorError(ValueError):
    """The expression cannot be evaluated (the message is what the model is shown)."""


def _digits_bound(value: Fraction) -> float:
    bits = max(value.numerator.bit_length(), value.denominator.bit_length())
    return bits / _LOG2_10


def evaluate(expression: str, max_digits: int = 1000) -> Fraction:
    """The exact value of ``expression`` (:class:`CalculatorError` when it has none here)."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError) as exc:
        raise CalculatorError(f"not an arithmetic expression ({type(exc).__name__})") from None

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return Fraction(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
            value = walk(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow):
                return power(left, right)
            if isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0:
                raise CalculatorError("division by zero")
            result = _BINARY[type(node.op)](left, right)
            if _digits_bound(result) > max_digits:
                raise CalculatorError(f"result has more than {max_digits} digits")
            return Fraction(result)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
            raise CalculatorError("'^' is not a power here: write ** for powers")
        raise CalculatorError("only integers, + - * / // % ** and parentheses are allowed")

    def power(base: Fraction, exponent: Fraction) -> Fraction:
        if exponent.denominator != 1:
            raise CalculatorError("exponents must be integers")
        if base == 0 and exponent < 0:
            raise CalculatorError("division by zero")
        if abs(base) not in (0, 1) and abs(exponent) * _digits_bound(base) > max_digits + 1:
            raise CalculatorError(f"result has more than {max_digits} digits")
        return base ** int(exponent)

    try:
        return walk(tree.body)
    except RecursionError:
        raise CalculatorError("expression nested too deeply") from None


def format_value(value: Fraction) -> str:
    """An integer's digits, or ``p/q`` for a fraction."""
    return (
        str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"
    )


class CalculatorTool(BaseTool):
    """Exact integer arithmetic (see the module docstring)."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None = None):
        super().__init__(config, tool_schema)
        self.max_digits = int(config.get("max_digits", 1000))
        self.max_expression_chars = int(config.get("max_expression_chars", 1000))
        if not 0 < self.max_digits <= 4000:  # str(int) refuses more than 4300 digits by default
            raise ValueError(f"max_digits must be in 1..4000, got {self.max_digits}")

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return getattr(self, "tool_schema", None) or DEFAULT_SCHEMA

    def calculate(self, expression: Any) -> str:
        """The tool's answer to ``expression``."""
        if not isinstance(expression, str) or not expression.strip():
            return "Error: 'expression' must be a non-empty string"
        if len(expression) > self.max_expression_chars:
            return f"Error: expression longer than {self.max_expression_chars} characters"
        try:
            return format_value(evaluate(expression, self.max_digits))
        except CalculatorError as exc:
            return f"Error: {exc}"

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict]:
        return ToolResponse(text=self.calculate(parameters.get("expression"))), 0.0, {}
