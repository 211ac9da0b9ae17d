"""Geometry3K (``hiyouga/geometry3k``): 0.9 × correct + 0.1 × well formatted.

Same semantics as verl 0.9.1's ``verl/utils/reward_score/geo3k.py``, on the same package it uses,
``mathruler`` (pinned): the answer is ``mathruler.grader.extract_boxed_content`` (the last
``\\boxed{...}``, braces matched; the text ``"None"`` when there is none) and correctness is
``mathruler.grader.grade_answer`` against the ground truth (PRM800K's normalisation and sympy
equality). The format is right when the whole response matches
``<think>...</think>...\\boxed{...}...`` (newlines allowed anywhere). Scores are 0.0, 0.1, 0.9
or 1.0; ``use_boxed=False`` grades the whole response instead of the boxed part.
"""

from __future__ import annotations

import re

__all__ = ["compute_score", "format_reward"]

_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def format_reward(predict_str: str) -> float:
    """1.0 when the response is ``<think>...</think>`` followed by a boxed answer, else 0.0."""
    return 1.0 if _FORMAT.fullmatch(predict_str) else 0.0


def compute_score(
    predict_str: str, ground_truth: str, use_boxed: bool = True, format_score: float = 0.1
) -> float:
    """``(1 - format_score) * correct + format_score * well_formatted``."""
    from mathruler.grader import extract_boxed_content, grade_answer

    answer = extract_boxed_content(predict_str) if use_boxed else predict_str
    correct = 1.0 if grade_answer(answer, ground_truth) else 0.0
    return (1.0 - format_score) * correct + format_score * format_reward(predict_str)
