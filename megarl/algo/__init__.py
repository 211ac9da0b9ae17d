"""RL math: pure tensor-in/tensor-out functions and the registries users pick from by name.

Shapes: B responses, T response tokens; masks are binary `[B, T]`. Nothing here uses
torch.distributed or config objects: the trainer passes plain keyword arguments named as in the
config (`clip_ratio_low`, `norm_adv_by_std_in_grpo`, ...); each estimator and loss declares
which it takes (`megarl.algo.registry`).
"""

from typing import Any

import torch

from megarl.algo.aggregation import LOSS_AGG_MODES, agg_loss, count_tokens_and_seqs
from megarl.algo.covariance_losses import (
    compute_policy_loss_clip_cov,
    compute_policy_loss_kl_cov,
    micro_batch_generator,
)
from megarl.algo.gae import compute_gae_advantage_return
from megarl.algo.group_advantages import (
    GroupStats,
    compute_gdpo_outcome_advantage,
    compute_gpg_outcome_advantage,
    compute_grpo_outcome_advantage,
    compute_grpo_passk_outcome_advantage,
    compute_opo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_rloo_outcome_advantage,
    group_ids,
)
from megarl.algo.kl import (
    KL_CONTROLLER_TYPES,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    compute_kl_loss,
    get_kl_controller,
    kl_penalty,
)
from megarl.algo.log_ratio import LOG_RATIO_BOUND, clamp_log_ratio
from megarl.algo.masked import masked_mean, masked_sum, masked_var, masked_whiten
from megarl.algo.optimal_baseline import (
    compute_optimal_token_baseline_advantage,
    compute_tir_optimal_token_baseline_advantage,
)
from megarl.algo.policy_loss import compute_policy_loss_gpg, compute_policy_loss_vanilla
from megarl.algo.registry import (
    ADV_ESTIMATORS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    get_adv_estimator,
    get_kl_estimator,
    get_policy_loss,
)
from megarl.algo.rollout_correction import (
    ROLLOUT_IS_LEVELS,
    ROLLOUT_LOG_PROB_MODES,
    compute_rollout_is_weights,
    select_old_log_prob,
)
from megarl.algo.scan import discounted_reverse_cumsum
from megarl.algo.sequence_losses import (
    compute_policy_loss_geo_mean,
    compute_policy_loss_gspo,
    compute_policy_loss_sapo,
)
from megarl.algo.token_advantages import (
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
)
from megarl.algo.value_loss import compute_entropy_loss, compute_value_loss, entropy_from_logits
from megarl.algo.weighted_logprob_losses import (
    compute_policy_loss_cispo,
    compute_policy_loss_dppo_kl,
    compute_policy_loss_dppo_tv,
    compute_policy_loss_dro,
)


def compute_advantage(adv_estimator: str, **supplied: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the estimator named `adv_estimator` with the inputs it declared, taken from
    `supplied` (`ADV_ESTIMATORS.inputs(name)`; others are not passed); ValueError naming a
    declared input that is missing. Returns (advantages, returns), both `[B, T]`."""
    return ADV_ESTIMATORS.call(adv_estimator, supplied)


def compute_policy_loss(
    policy_loss: str, **supplied: Any
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Run the policy loss named `policy_loss` with the inputs it declared, taken from
    `supplied` (ValueError naming a declared input that is missing). Returns (loss, metrics)."""
    return POLICY_LOSSES.call(policy_loss, supplied)


__all__ = [
    "ADV_ESTIMATORS",
    "KL_CONTROLLER_TYPES",
    "KL_ESTIMATORS",
    "LOG_RATIO_BOUND",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "ROLLOUT_IS_LEVELS",
    "ROLLOUT_LOG_PROB_MODES",
    "AdaptiveKLController",
    "FixedKLController",
    "GroupStats",
    "agg_loss",
    "apply_kl_penalty",
    "clamp_log_ratio",
    "compute_advantage",
    "compute_entropy_loss",
    "compute_gae_advantage_return",
    "compute_gdpo_outcome_advantage",
    "compute_gpg_outcome_advantage",
    "compute_grpo_outcome_advantage",
    "compute_grpo_passk_outcome_advantage",
    "compute_kl_loss",
    "compute_opo_outcome_advantage",
    "compute_optimal_token_baseline_advantage",
    "compute_policy_loss",
    "compute_policy_loss_cispo",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_dppo_kl",
    "compute_policy_loss_dppo_tv",
    "compute_policy_loss_dro",
    "compute_policy_loss_geo_mean",
    "compute_policy_loss_gpg",
    "compute_policy_loss_gspo",
    "compute_policy_loss_kl_cov",
    "compute_policy_loss_sapo",
    "compute_policy_loss_vanilla",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_rollout_is_weights",
    "compute_tir_optimal_token_baseline_advantage",
    "compute_value_loss",
    "count_tokens_and_seqs",
    "discounted_reverse_cumsum",
    "entropy_from_logits",
    "get_adv_estimator",
    "get_kl_controller",
    "get_kl_estimator",
    "get_policy_loss",
    "group_ids",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "micro_batch_generator",
    "select_old_log_prob",
]
