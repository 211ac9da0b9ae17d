"""GSM8K: the answer after ``####`` (strict) or the last number (flexible), compared as text.

Same semantics as verl 0.9.1's ``verl/utils/reward_score/gsm8k.py`` (written from its
behaviour). Only the last 300 characters of the response are searched: an answer sits at the
end, and regular expressions on very long degenerate responses are slow.
"""

from __future__ import annotations

import re

__all__ = ["compute_score", "extract_solution"]

CLIP_CHARS = 300
_STRICT = re.compile(r"#### (-?[0-9.,]+)")
_NUMBER = re.compile(r"-?[0-9.,]+")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The answer text of ``solution_str`` (None when there is none).

    ``strict``: the last ``#### <number>`` (the number ``-?[0-9.,]+``), commas and ``$``
    removed; ``flexible``: the last run of ``-?[0-9.,]+`` that is not ``""`` or ``"."``, commas
    kept (so ``1,000`` does not equal ``1000`` there, as in verl).
    """
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k: method must be 'strict' or 'flexible', got {method!r}")
    tail = solution_str[-CLIP_CHARS:]
    if method == "strict":
        found = _STRICT.findall(tail)
        return found[-1].replace(",", "").replace("$", "") if found else None
    found = _NUMBER.findall(tail)
    if not found:
        return None
    meaningful = [text for text in found if text not in ("", ".")]
    # verl's loop leaves its variable on the first match when every match is "." or "".
    return meaningful[-1] if meaningful else found[0]


def compute_score(
    solution_str: str,
    ground_truth: str,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """``score`` for the right answer, ``format_score`` for a wrong one, 0 for none."""
    answer = extract_solution(solution_str, method)
    if answer is None:
        return 0.0
    return float(score) if answer == ground_truth else float(format_score)
