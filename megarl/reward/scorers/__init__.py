"""Rule-based scorers chosen by ``data_source``, with verl 0.9.1's routing and semantics.

:func:`default_compute_score` has verl's signature ``(data_source, solution_str, ground_truth,
extra_info=None, **reward_kwargs) -> float | dict`` and routes every data_source verl 0.9.1's
``default_compute_score`` routes (the table is ``_EXACT``; ``aime*`` goes to math_dapo), plus
megarl's synthetic ``megarl/digit_sum``. Scorer modules are imported on first use, so a scoring
worker loads only what its samples need. Extra keyword arguments go to the code scorer only
(``test_timeout_s``, ``all_tests_timeout_s``, ``memory_limit_mb``, ``sandbox_fusion_url``), as in
verl; code runs locally unless ``sandbox_fusion_url`` names a Sandbox Fusion service.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

__all__ = ["UnsupportedDataSource", "default_compute_score", "scorer_module_for"]

_NUMINA = ("aops_forum", "synthetic_math", "amc_aime", "synthetic_amc", "cn_k12", "olympiads")
_EXACT = {
    "openai/gsm8k": "gsm8k",
    "lighteval/MATH": "hendrycks_math",
    "DigitalLearningGmbH/MATH-lighteval": "hendrycks_math",
    "HuggingFaceH4/MATH-500": "hendrycks_math",
    "math_dapo": "math_dapo",
    "math": "math_dapo",
    "math_dapo_reasoning": "math_dapo",
    **{
        f"searchR1_{name}": "qa_em"
        for name in ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique")
    },
    "searchR1_bamboogle": "qa_em",
    **{f"numina_{name}": "prime_math" for name in _NUMINA},
    "hiyouga/geometry3k": "geo3k",
    **dict.fromkeys(["codecontests", "apps", "codeforces", "taco"], "code"),
}


class UnsupportedDataSource(NotImplementedError):
    """No built-in scorer for a ``data_source``."""


def scorer_module_for(data_source: str) -> str:
    """Dotted module whose ``compute_score(solution_str, ground_truth)`` scores ``data_source``."""
    from megarl.data.synthetic import DATA_SOURCE as SYNTHETIC

    if data_source == SYNTHETIC:
        return "megarl.data.synthetic"
    name = _EXACT.get(data_source) or ("math_dapo" if data_source.startswith("aime") else None)
    if name is not None:
        return f"{__name__}.{name}"
    raise UnsupportedDataSource(
        f"no built-in reward function for data_source {data_source!r}; set "
        "custom_reward_function.path/name (verl's signature compute_score(data_source, "
        "solution_str, ground_truth, extra_info=None, **kwargs))"
    )


def default_compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
    **reward_kwargs: Any,
) -> float | dict[str, Any]:
    """Score one response with the built-in scorer of its ``data_source`` (float or dict)."""
    module = _import_scorer(scorer_module_for(data_source))
    if module.__name__ == f"{__name__}.code":  # as in verl, only code takes the keywords
        return module.compute_score(solution_str, ground_truth, **reward_kwargs)
    result = module.compute_score(solution_str, ground_truth)
    if isinstance(result, dict):
        return result
    return float(result)


def _import_scorer(dotted: str) -> ModuleType:
    """The scorer module ``dotted`` (imported on first use: workers load only what they need)."""
    if dotted == "megarl.data.synthetic":
        from megarl.data import synthetic

        return synthetic
    if dotted == f"{__name__}.gsm8k":
        from megarl.reward.scorers import gsm8k

        return gsm8k
    if dotted == f"{__name__}.hendrycks_math":
        from megarl.reward.scorers import hendrycks_math

        return hendrycks_math
    if dotted == f"{__name__}.math_dapo":
        from megarl.reward.scorers import math_dapo

        return math_dapo
    if dotted == f"{__name__}.prime_math":
        from megarl.reward.scorers import prime_math

        return prime_math
    if dotted == f"{__name__}.geo3k":
        from megarl.reward.scorers import geo3k

        return geo3k
    if dotted == f"{__name__}.code":
        from megarl.reward.scorers import code

        return code
    from megarl.reward.scorers import qa_em

    return qa_em
