"""MATH (``lighteval/MATH``, ``DigitalLearningGmbH/MATH-lighteval``, ``HuggingFaceH4/MATH-500``).

Same semantics as verl 0.9.1's ``verl/utils/reward_score/math_reward.py`` (itself the
lm-evaluation-harness Hendrycks-MATH normalisation), written from its behaviour, quirks included:
``0.5`` and ``\\frac{1}{2}`` are equal (the normaliser maps exactly ``0.5``), ``0.25`` and
``\\frac{1}{4}`` are not.
"""

from __future__ import annotations

from megarl.reward.scorers.boxed import closing_brace, last_box_start

__all__ = ["compute_score", "is_equiv", "last_boxed_only_string", "strip_string"]


class _Malformed(Exception):
    """The normaliser met text it cannot handle (verl falls back to a raw comparison)."""


def last_boxed_only_string(text: str) -> str | None:
    """The last ``\\boxed{...}``/``\\fbox{...}`` (or ``\\boxed `` form) of ``text``, or None."""
    if "\\boxed " in text:
        return "\\boxed " + text.split("\\boxed ")[-1].split("$")[0]
    start = last_box_start(text)
    if start is None:
        return None
    end = closing_brace(text, start)
    return None if end is None else text[start : end + 1]


def _unbox(boxed: str) -> str:
    if "\\boxed " in boxed:
        if not boxed.startswith("\\boxed "):
            raise _Malformed(boxed)
        return boxed[len("\\boxed ") :]
    if not (boxed.startswith("\\boxed{") and boxed.endswith("}")):
        raise _Malformed(boxed)  # e.g. \fbox{...}: verl's assertion fails and the score is 0
    return boxed[len("\\boxed{") : -1]


def _braced_fracs(text: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{72}`` -> ``\\frac{1}{72}``."""
    head, *pieces = text.split("\\frac")
    out = [head]
    for piece in pieces:
        out.append("\\frac")
        if not piece:
            raise _Malformed(text)  # "\frac" at the very end
        if piece[0] == "{":
            out.append(piece)
            continue
        if len(piece) < 2:
            return text  # verl gives up on the whole string here
        num, den, rest = piece[0], piece[1], piece[2:]
        out.append(f"{{{num}}}{den}{rest}" if den == "{" else f"{{{num}}}{{{den}}}{rest}")
    return "".join(out)


def _slash_to_frac(text: str) -> str:
    """``3/4`` (two plain integers) -> ``\\frac{3}{4}``; anything else unchanged."""
    parts = text.split("/")
    if len(parts) != 2:
        return text
    try:
        num, den = int(parts[0]), int(parts[1])
    except ValueError:
        return text
    return f"\\frac{{{num}}}{{{den}}}" if text == f"{num}/{den}" else text


def _drop_units(text: str) -> str:
    parts = text.split("\\text{ ")
    if len(parts) == 1:
        return text
    if len(parts) != 2:
        raise _Malformed(text)
    return parts[0]


def _braced_sqrt(text: str) -> str:
    """``\\sqrt3`` -> ``\\sqrt{3}``."""
    head, *pieces = text.split("\\sqrt")
    out = [head]
    for piece in pieces:
        if not piece:
            raise _Malformed(text)  # "\sqrt" at the very end
        out.append("\\sqrt" + piece if piece[0] == "{" else f"\\sqrt{{{piece[0]}}}{piece[1:]}")
    return "".join(out)


def strip_string(text: str) -> str:
    """Hendrycks-MATH normal form of an answer; raises ``_Malformed`` where verl's does."""
    for old, new in (
        ("\n", ""),
        ("\\!", ""),
        ("\\\\", "\\"),
        ("tfrac", "frac"),
        ("dfrac", "frac"),
        ("\\left", ""),
        ("\\right", ""),
        ("^{\\circ}", ""),
        ("^\\circ", ""),
        ("\\$", ""),
    ):
        text = text.replace(old, new)
    text = _drop_units(text)
    text = text.replace("\\\\%", "").replace("\\%", "")
    text = text.replace(" .", " 0.").replace("{.", "{0.")
    if not text:
        return text
    if text[0] == ".":
        text = "0" + text
    lhs_rhs = text.split("=")
    if len(lhs_rhs) == 2 and len(lhs_rhs[0]) <= 2:  # "k = 3" -> " 3"
        text = lhs_rhs[1]
    text = _braced_sqrt(text)
    text = text.replace(" ", "")
    text = _braced_fracs(text)
    if text == "0.5":
        text = "\\frac{1}{2}"
    return _slash_to_frac(text)


def is_equiv(answer: str | None, truth: str | None) -> bool:
    """Equal after :func:`strip_string`; the raw strings are compared when normalising either
    fails (a malformed ``\\frac``/``\\sqrt``, two ``\\text{ `` units), as verl does."""
    if answer is None or truth is None:
        return answer is None and truth is None
    try:
        return strip_string(answer) == strip_string(truth)
    except (_Malformed, IndexError):
        return answer == truth


def compute_score(solution_str: str, ground_truth: str) -> float:
    """1.0 when the last boxed answer equals ``ground_truth`` after normalisation, else 0.0.

    The answer is the last ``\\boxed{...}`` (braces matched) or, failing that, ``\\fbox{...}``;
    when the text contains ``\\boxed `` (with a space), what follows the last ``\\boxed `` up
    to the next ``$``. An ``\\fbox`` answer, or none, scores 0. Answer and ground truth are
    compared by :func:`is_equiv`. A missing response (None, as verl's reward loop can pass)
    scores 0.0, as in verl, where any exception inside the scorer yields 0.0."""
    if not isinstance(solution_str, str):
        return 0.0
    boxed = last_boxed_only_string(solution_str)
    if boxed is None:
        return 0.0
    try:
        answer = _unbox(boxed)
    except _Malformed:
        return 0.0
    return 1.0 if is_equiv(answer, ground_truth) else 0.0
