"""DAPO math (``math_dapo``, ``math``, ``math_dapo_reasoning``, ``aime*``): +1 right, -1 wrong.

Same semantics as verl 0.9.1's ``verl/utils/reward_score/math_dapo.py``, written from its
behaviour (rules: :func:`verify`). Only the last 300 characters of the response count.
"""

from __future__ import annotations

import re
from typing import Any

from megarl.reward.scorers.boxed import closing_brace

__all__ = ["compute_score", "last_boxed_only_string", "normalize_final_answer"]

INVALID = "[INVALID]"
_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")

_REPLACEMENTS = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
# Units and filler words deleted from an answer, in this order.
_DELETED = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots",
    "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds",
    "meters", "meals", "edges", "students", "childrentickets", "multiples", "\\text{s}",
    "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}",
    "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
)  # fmt: skip
# (pattern, replacement) applied in order after the plain replacements.
_REWRITES = tuple(
    (re.compile(pattern), repl)
    for pattern, repl in (
        (r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$"),  # keep only the first $...$ span
        (r"(\\text\{)(.*?)(\})", "\\2"),
        (r"(\\textbf\{)(.*?)(\})", "\\2"),
        (r"(\\overline\{)(.*?)(\})", "\\2"),
        (r"(\\boxed\{)(.*)(\})", "\\2"),
        (r"(frac)([^{])(.)", "frac{\\2}{\\3}"),  # \fracab -> \frac{a}{b}
        (r"(sqrt)([^{])", "sqrt{\\2}"),  # \sqrta -> \sqrt{a}
    )
)


def normalize_final_answer(answer: str) -> str:
    """Minerva normal form of a final answer."""
    answer = answer.split("=")[-1]
    for old, new in _REPLACEMENTS:
        answer = answer.replace(old, new)
    for word in _DELETED:
        answer = answer.replace(word, "")
    for pattern, repl in _REWRITES:
        answer = pattern.sub(repl, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def last_boxed_only_string(text: str) -> str | None:
    """The last ``\\boxed{...}`` of ``text`` with matched braces, or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    end = closing_brace(text, start)
    return None if end is None else text[start : end + 1]


def _boxed_verbatim(solution: str, truth: str) -> tuple[bool, str | None]:
    boxed = last_boxed_only_string(solution[-100:])
    pred = boxed[len("\\boxed{") : -1] if boxed is not None else None
    return pred == truth, pred


def verify(solution: str, truth: str, strict_box_verify: bool = False) -> tuple[bool, str | None]:
    """(correct, prediction) of a (clipped) solution.

    Minerva style first: the last ``Answer: ...`` line (case-insensitive), normalised by
    :func:`normalize_final_answer` (text after the last ``=``, units and LaTeX wrappers
    dropped), against the equally normalised ground truth. With no ``Answer:`` line, the last
    ``\\boxed{...}`` within the final 100 characters against the ground truth **verbatim**;
    with neither, the prediction is ``"[INVALID]"``. ``strict_box_verify`` uses only the boxed
    comparison.
    """
    if strict_box_verify:
        return _boxed_verbatim(solution, truth)
    lines = _ANSWER_LINE.findall(solution)
    pred = normalize_final_answer(lines[-1] if lines else INVALID)
    correct = pred == normalize_final_answer(truth)
    if pred != INVALID:
        return correct, pred
    box_correct, box_pred = _boxed_verbatim(solution, truth)
    if box_pred is not None:
        return box_correct, box_pred
    return correct, pred


def compute_score(
    solution_str: str, ground_truth: str, strict_box_verify: bool = False
) -> dict[str, Any]:
    """``{"score": ±1.0, "acc": bool, "pred": str | None}``."""
    correct, pred = verify(solution_str[-300:], ground_truth, strict_box_verify)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
