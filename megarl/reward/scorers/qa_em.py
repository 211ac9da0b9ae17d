"""Search-R1 style QA (``searchR1_*``): exact match of the last ``<answer>...</answer>``.

Same semantics as verl 0.9.1's ``verl/utils/reward_score/search_r1_like_qa_em.py``, written from
its behaviour: the last ``<answer>...</answer>`` span (across lines, stripped) is compared with
each of ``ground_truth["target"]`` (a string or a list of strings) after SQuAD normalisation
(lower case, punctuation and the articles a/an/the removed, whitespace collapsed). A match scores
1.0, or 0.25 when the response holds more than 10 opening or closing answer tags; a wrong answer
scores ``format_score`` (0.0); no answer 0. (verl also prints one sample in 64; megarl does not.)
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["compute_score", "normalize_answer"]

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces."""
    text = text.lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _targets(ground_truth: Mapping[str, Any]) -> Iterable[str]:
    target = ground_truth["target"]
    return [target] if isinstance(target, str) else target


def compute_score(
    solution_str: str,
    ground_truth: Mapping[str, Any],
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """``score`` for an exact match (a quarter of it with > 10 answer tags), else as above."""
    matches = _ANSWER.findall(solution_str)
    if not matches:
        return 0.0
    answer = normalize_answer(matches[-1].strip())
    if not any(normalize_answer(t) == answer for t in _targets(ground_truth)):
        return float(format_score)
    if solution_str.count("<answer>") > 10 or solution_str.count("</answer>") > 10:
        return score / 4
    return float(score)
