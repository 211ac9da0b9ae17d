"""Names users choose from (estimators, loss modes, KL estimators, loggers).

Kept here rather than imported from ``megarl.algo`` so that loading and validating a config
stays import-light; a test in ``tests/config`` keeps the lists in step with the registries.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence
from typing import Literal, get_args

AdvEstimator = Literal[
    "gae",
    "grpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "opo",
    "gpg",
    "grpo_passk",
    "gdpo",
    "optimal_token_baseline",
    "tir_optimal_token_baseline",
]
ADV_ESTIMATORS: tuple[str, ...] = get_args(AdvEstimator)
GROUP_ESTIMATORS: tuple[str, ...] = (
    "grpo",
    "rloo",
    "grpo_passk",
    "opo",
    "gpg",
    "reinforce_plus_plus_baseline",
    "gdpo",
    "optimal_token_baseline",
    "tir_optimal_token_baseline",
)
"""Estimators whose baseline comes from the other responses to the same prompt (need n >= 2)."""

LossAggMode = Literal[
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
]
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAggMode)
KLType = Literal[
    "kl", "abs", "mse", "low_var_kl", "full",
    "k1", "k2", "k3",  # verl's aliases of kl, mse, low_var_kl
    "kl+", "k1+", "abs+", "low_var_kl+", "k3+",  # value of the estimator, gradient of k2
    "mse+", "k2+",  # verl's names for k2 itself
]  # fmt: skip
KL_TYPES: tuple[str, ...] = get_args(KLType)
RolloutIsLevel = Literal["token", "sequence"]
ROLLOUT_IS_LEVELS: tuple[str, ...] = get_args(RolloutIsLevel)
"""Levels of the rollout importance weights (``megarl.algo.compute_rollout_is_weights``)."""
ROLLOUT_LOG_PROB_MODES: tuple[str, ...] = ("decoupled", "bypass")
"""``megarl.algo.select_old_log_prob``'s modes: bypass_mode false and true."""
PolicyLossMode = Literal[
    "vanilla", "gpg", "gspo", "sapo", "cispo", "geo_mean", "dppo_tv", "dppo_kl", "kl_cov",
    "clip_cov", "dro",
]  # fmt: skip
SEQUENCE_AGGREGATED_LOSSES: tuple[str, ...] = ("sapo", "geo_mean")
"""Policy losses that aggregate per sequence whatever ``loss_agg_mode`` says (as verl)."""
POLICY_LOSS_MODES: tuple[str, ...] = get_args(PolicyLossMode)
LOGGERS: tuple[str, ...] = ("console", "mlflow", "wandb", "tensorboard")
LOGGER_EXTRAS: dict[str, tuple[str, str]] = {
    "wandb": ("wandb", "wandb"),
    "tensorboard": ("tensorboard", "tensorboard"),
}
"""Loggers that need an optional extra: logger -> (module it imports, ``megarl[extra]``)."""


def missing_logger_extras(loggers: Sequence[str]) -> list[str]:
    """One line per chosen logger whose optional extra is not installed (without importing it)."""
    lines = []
    for name in loggers:
        if name not in LOGGER_EXTRAS:
            continue
        module, extra = LOGGER_EXTRAS[name]
        if module in sys.modules:  # already imported, or blocked (None)
            present = sys.modules[module] is not None
        else:
            present = importlib.util.find_spec(module) is not None
        if not present:
            lines.append(
                f"trainer.logger has {name} but the {module} package is not installed: "
                f"pip install 'megarl[{extra}]'"
            )
    return lines
