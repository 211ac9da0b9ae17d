"""``\\boxed{...}`` brace matching shared by the math scorers (MATH, DAPO, PRIME).

verl's math scorers each carry their own copy of one loop: from the start of the last
``\\boxed`` (or ``\\fbox``), count ``{`` up and ``}`` down, and stop at the ``}`` that brings the
count back to zero. They differ only in where they start and what they return, which stays in
each scorer; the loop itself (and where the last box starts) lives here once.
"""

from __future__ import annotations

__all__ = ["closing_brace", "last_box_start"]


def last_box_start(text: str) -> int | None:
    """Where the last ``\\boxed`` starts or, when there is none, the last ``\\fbox``; else None."""
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
    return start if start >= 0 else None


def closing_brace(text: str, start: int) -> int | None:
    """Index of the ``}`` at which the brace depth counted from ``text[start]`` returns to zero.

    None when the braces never balance (an unclosed ``\\boxed{``). A stray ``}`` before the
    first ``{`` makes the depth negative, exactly as in verl's loop.
    """
    depth = 0
    for pos in range(start, len(text)):
        if text[pos] == "{":
            depth += 1
        elif text[pos] == "}":
            depth -= 1
            if depth == 0:
                return pos
    return None
