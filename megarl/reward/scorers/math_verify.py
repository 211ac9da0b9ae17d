"""Math-Verify grading: verl 0.9.1's opt-in ``math_verify`` scorer, on the ``math-verify`` package.

A user picks it with ``custom_reward_function.path=megarl.reward.scorers.math_verify`` (function
``compute_score``). verl runs each call in a spawn-process pool of its own with a 30 s limit;
here the call already runs in a scoring worker (on its main thread, so Math-Verify's own
``signal.alarm`` timeouts work) under the reward manager's per-sample limit, and no second pool
is started.
"""

from __future__ import annotations

from typing import Any

__all__ = ["compute_score", "math_verify_score"]


def math_verify_score(model_output: str, ground_truth: str, timeout_score: float = 0.0) -> float:
    """1.0 when Math-Verify finds the response equal to ``ground_truth``, else 0.0.

    As verl 0.9.1: the ground truth is wrapped in ``\\boxed{}`` and parsed as LaTeX, the response
    parsed as a plain expression and as LaTeX; 1.0 when some prediction verifies against some
    gold answer. Math-Verify's ``TimeoutException`` scores ``timeout_score``, any other error 0.
    """
    from math_verify.errors import TimeoutException
    from math_verify.grader import verify
    from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig, parse

    try:
        gold = parse("\\boxed{" + ground_truth + "}", (LatexExtractionConfig(),))
        preds = parse(model_output, (ExprExtractionConfig(), LatexExtractionConfig()))
        if not gold or not preds:
            return 0.0
        return max(1.0 if any(verify(g, p) for g in gold) else 0.0 for p in preds)
    except TimeoutException:
        return float(timeout_score)
    except Exception:  # noqa: BLE001 -- verl scores any Math-Verify failure 0 (a wrong answer)
        return 0.0


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict[str, Any] | None = None,
    **reward_kwargs: Any,
) -> float:
    """verl's custom-reward signature around :func:`math_verify_score` (any data_source)."""
    return math_verify_score(solution_str, ground_truth, **reward_kwargs)
