"""The ToRA-style second opinion of verl 0.9.1's PRIME math grader (``prime_math/grader.py``).

:func:`pi_aware_math_equal` is what verl's ``prime_math.compute_score`` asks when the PRM800K
grader (:mod:`megarl.reward.scorers.prime_math`) says "not equal"; written from verl's behaviour
(rules: :func:`math_equal`). Deliberately unlike verl, which passes model output to Python's
``eval`` and sympy's ``parse_expr``, megarl evaluates only arithmetic on number literals
(:func:`evaluate_arithmetic`, exponents over 10 000 refused) and reads ``Matrix([...])`` entries
the same way, as sympy numbers; text with names or calls is not evaluated (verl would).
"""

from __future__ import annotations

import ast
import math
import operator
import re
from math import isclose
from typing import Any

__all__ = ["evaluate_arithmetic", "math_equal", "pi_aware_math_equal"]

_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: operator.pow, ast.BitAnd: operator.and_, ast.BitOr: operator.or_,
    ast.BitXor: operator.xor, ast.LShift: operator.lshift, ast.RShift: operator.rshift,
}  # fmt: skip
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg, ast.Invert: operator.invert}
_MAX_EXPONENT = 10_000
_INTERVALS = (
    (re.compile(r"^Interval\((.*)\)$"), "[{}]"),
    (re.compile(r"^Interval\.Ropen\((.*)\)$"), "[{})"),
    (re.compile(r"^Interval\.Lopen\((.*)\)$"), "({}]"),
    (re.compile(r"^Interval\.open\((.*)\)$"), "({})"),
)
_PMATRIX = r"\begin{pmatrix}"


def evaluate_arithmetic(text: str, number: type | None = None) -> Any:
    """Python's value of ``text`` when it is arithmetic on number literals (or tuples/lists of
    such); ``ValueError`` (or ``SyntaxError``/``ZeroDivisionError``...) otherwise.

    ``number``, when given, converts each literal first (``sympy.sympify`` to read sympy numbers,
    as sympy's ``parse_expr`` does).
    """
    tree = ast.parse(text.lstrip(" \t"), mode="eval")  # eval() ignores leading blanks too

    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and type(node.value) in (bool, int, float, complex):
            return node.value if number is None else number(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
                raise ValueError(f"exponent {right} refused")
            return _BINARY[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        if isinstance(node, ast.Tuple):
            return tuple(value(elt) for elt in node.elts)
        if isinstance(node, ast.List):
            return [value(elt) for elt in node.elts]
        raise ValueError(f"not arithmetic: {ast.dump(node)[:80]}")

    return value(tree.body)


def _as_number(text: Any) -> float | None:
    """verl's ``is_digit``: ``float`` of the text without thousands commas, or None."""
    text = str(text)
    try:
        return float(text.replace("{,}", "") if "{,}" in text else text.replace(",", ""))
    except ValueError:
        return None


def _substitute_pi(text: str, pi: float) -> Any:
    """``2\\pi`` -> ``2*pi``, ``\\pi`` -> ``1*pi``, then its arithmetic value (else the text)."""
    pos = text.find("\\pi")
    while pos != -1:
        factor = "*" if pos > 0 and text[pos - 1].isdigit() else "1*"
        text = f"{text[:pos]}{factor}{pi}{text[pos + 3 :]}"
        pos = text.find("\\pi", pos + 1)
    try:
        return evaluate_arithmetic(text)
    except Exception:  # noqa: BLE001 -- verl suppresses any eval failure and keeps the text
        return text


def _normalize(answer: Any, pi: float) -> Any:
    if not isinstance(answer, str):
        return answer
    if re.match(r"\$\d+(\.\d+)?", answer):
        return answer[1:]
    if re.match(r"^\d+(\.\d+)?%$", answer) or re.match(r"^\d+(\.\d+)?\\%$", answer):
        return answer.replace("\\%", "").replace("%", "")
    if "_" in answer:  # a number in a base: 101_2 -> 101 (ValueError when not a number, as verl)
        return int(float(answer.split("_")[0]))
    if "\\pi" in answer:
        return _substitute_pi(answer, pi)
    return answer


def _numbers_equal(
    prediction: float, reference: float, include_percentage: bool, tol: float
) -> bool:
    candidates = (
        [reference / 100, reference, reference * 100] if include_percentage else [reference]
    )
    return any(isclose(item, prediction, rel_tol=tol) for item in candidates)


def _parts_equal(preds: list, refs: list, include_percentage: bool, tol: float) -> bool:
    """All parts equal (every part is compared, as verl does, so a part that raises always does)."""
    verdicts = [math_equal(p, r, include_percentage, tol) for p, r in zip(preds, refs, strict=True)]
    return all(verdicts)


def _matrix_equal(prediction: str, reference: str, include_percentage: bool, tol: float) -> bool:
    """``Matrix([...])`` or ``[[...]]`` against a ``pmatrix`` reference."""
    if prediction.startswith("Matrix"):
        from sympy import Matrix, sympify

        refs = reference.split()[1:-1:2]
        try:
            args = evaluate_arithmetic(prediction[len("Matrix") :], sympify)
            entries = list(Matrix(*(args if isinstance(args, tuple) else (args,))))
            return len(entries) == len(refs) and _parts_equal(
                entries, refs, include_percentage, tol
            )
        except Exception:  # noqa: BLE001 -- verl catches any failure of this comparison
            return False
    if not (prediction.startswith("[") and prediction.endswith("]")):
        return False
    rows = evaluate_arithmetic(prediction)  # raises where verl's bare eval raises: not equal
    if not isinstance(rows, list):
        return False
    body = reference.removeprefix(r"\\begin{pmatrix}").removeprefix(_PMATRIX)
    body = body.removesuffix(r"\\end{pmatrix}").removesuffix(r"\end{pmatrix}")
    refs = [row.split("&") if "&" in row else row for row in body.split("\\")]
    try:
        return len(rows) == len(refs) and _parts_equal(rows, refs, include_percentage, tol)
    except Exception:  # noqa: BLE001 -- verl catches errors from the row comparisons here
        return False


def _structured_equal(
    prediction: str, reference: str, include_percentage: bool, tol: float
) -> bool | None:
    """Tuples, intervals, comma lists, points and matrices; None when no rule decides."""
    pred_str, ref_str = prediction, reference
    if (
        prediction.startswith("[") and prediction.endswith("]") and not reference.startswith("(")
    ) or (
        prediction.startswith("(") and prediction.endswith(")") and not reference.startswith("[")
    ):
        pred_str, ref_str = pred_str.strip("[]()"), ref_str.strip("[]()")
    for bracket in "{}()":
        pred_str, ref_str = pred_str.replace(bracket, ""), ref_str.replace(bracket, "")
    if pred_str == ref_str:
        return True
    if (
        prediction
        and reference
        and prediction[0] in "(["
        and prediction[-1] in ")]"
        and (prediction[0], prediction[-1]) == (reference[0], reference[-1])
    ):
        preds, refs = prediction[1:-1].split(","), reference[1:-1].split(",")
        if len(preds) == len(refs) and _parts_equal(preds, refs, include_percentage, tol):
            return True
    if "," in prediction and "," in reference:
        preds = [item.strip() for item in prediction.split(",")]
        refs = [item.strip() for item in reference.split(",")]
        if len(preds) == len(refs):
            return _parts_equal(preds, refs, include_percentage, tol)  # decides, either way
    if prediction.startswith("Point") and reference[0] == "(" and reference[-1] == ")":
        preds = prediction[prediction.find("(") + 1 : -1].split(",")
        refs = reference[1:-1].split(",")
        if len(preds) == len(refs) and _parts_equal(preds, refs, include_percentage, tol):
            return True
    if _PMATRIX in reference and _matrix_equal(prediction, reference, include_percentage, tol):
        return True
    return None


def math_equal(
    prediction: Any,
    reference: Any,
    include_percentage: bool = True,
    tolerance: float = 1e-4,
    pi: float = math.pi,
) -> bool:
    """verl's ``math_equal`` (without its symbolic step, which never succeeds in verl 0.9.1).

    ``$12`` -> ``12``; ``45%`` / ``45\\%`` -> ``45``; a number in a base (``101_2``) -> its
    leading digits as an integer; ``\\pi`` becomes ``*pi`` (or ``1*pi``) and the text is
    evaluated as arithmetic. Equal as text (case- and space-insensitive), or as numbers within
    ``tolerance`` relative (the reference also ×100 and ÷100, for percentages), or element-wise
    for tuples/intervals and comma lists, ``Point(...)`` against a tuple, ``Matrix(...)`` or
    ``[[...]]`` against a ``pmatrix``. verl 0.9.1's symbolic step wraps its comparison in
    ``with timeout_limit(...)``, a decorator factory: the ``with`` raises ``TypeError``, which
    verl catches, so it never says "equal"; leaving it out gives the same values.

    Raises where verl raises (a base-number ``_`` with a non-number before it, a malformed
    ``[...]`` against a matrix); :func:`pi_aware_math_equal` turns that into "not equal".
    """
    prediction, reference = _normalize(prediction, pi), _normalize(reference, pi)
    if isinstance(prediction, str) and len(prediction) > 1000:
        prediction = prediction[:1000]
    if isinstance(prediction, str) and isinstance(reference, str):
        if prediction.strip().lower() == reference.strip().lower():
            return True
        if prediction.replace(" ", "") == reference.replace(" ", ""):
            return True
    pred_num, ref_num = _as_number(prediction), _as_number(reference)
    if pred_num is not None and ref_num is not None:
        return _numbers_equal(pred_num, ref_num, include_percentage, tolerance)
    if not prediction and prediction not in (0, False):
        return False
    prediction, reference = str(prediction).strip(), str(reference).strip()
    for pattern, template in _INTERVALS:
        found = pattern.match(prediction)
        if found:
            prediction = template.format(found.group(1))
            break
    return bool(_structured_equal(prediction, reference, include_percentage, tolerance))


def pi_aware_math_equal(answer: str, ground_truth: str) -> bool:
    """:func:`math_equal`, tried with ``math.pi`` and ``3.14`` when ``\\pi`` appears; False when
    the comparison raises (as verl's ``try``/``except`` around it)."""
    try:
        if "\\pi" in answer or "\\pi" in ground_truth:
            return any([math_equal(answer, ground_truth, pi=pi) for pi in (math.pi, 3.14)])  # noqa: C419
        return math_equal(answer, ground_truth)
    except Exception:  # noqa: BLE001 -- verl scores any failure of this comparison as wrong
        return False
