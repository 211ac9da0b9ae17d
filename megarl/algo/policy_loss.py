"""Policy-gradient losses (`actor.policy_loss.loss_mode`): PPO clip with clip-higher and dual-clip,
and GPG. The rest of verl 0.9.1's menu: `sequence_losses.py`, `weighted_logprob_losses.py` and
`covariance_losses.py`.

Every loss is written against `PolicyLossInputs` (`policy_loss_inputs.py`) and returns
`(loss, metrics)`: a scalar (rollout IS weights, if given, weight the per-token loss before
`agg_loss`) and a dict of detached 0-dim tensors (no `.item()`, so no device sync).
"""

from __future__ import annotations

import torch

from megarl.algo.masked import masked_sum
from megarl.algo.policy_loss_inputs import (
    LossAndMetrics,
    PolicyLossInputs,
    clip_bounds,
    policy_loss,
)


@policy_loss(
    "vanilla", settings=("clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c")
)
def compute_policy_loss_vanilla(
    inputs: PolicyLossInputs,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
) -> LossAndMetrics:
    """PPO clipped surrogate (arXiv:1707.06347), DAPO clip-higher and dual-clip (arXiv:1912.09729).

        ratio = exp(clamp(log_prob - old_log_prob, -20, 20))
        l1 = -A * ratio,  l2 = -A * clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
        l  = max(l1, l2);  where A < 0: l = min(l, -A * clip_ratio_c)
    Worked example: log-probs -1.5 (new) vs -2.0 (old), A = 0.5, eps = 0.2:
    ratio = 1.65, l1 = -0.825, l2 = -0.6, loss = -0.6.

    Args:
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, rollout_is_weights,
            global_token_count, global_seq_count, loss_scale_factor, seq_token_counts: see
            `PolicyLossInputs`.
        clip_ratio: eps, used for either side not given separately.
        clip_ratio_low, clip_ratio_high: eps_low / eps_high (clip-higher: eps_high > eps_low).
        clip_ratio_c: dual-clip bound c > 1 for negative advantages.

    Returns:
        loss (scalar), metrics {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"}: fraction of tokens
        where the ratio clip is active, fraction of tokens with A < 0 where the dual clip is active,
        and the mean of old_log_prob - log_prob (clamped), all over the mask.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (dual-clip PPO), got {clip_ratio_c}")
    low, high = clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    advantages = inputs.advantages
    log_ratio = inputs.log_ratio()
    ratio = torch.exp(log_ratio)
    losses_unclipped = -advantages * ratio
    losses_clipped = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    clip_losses = torch.maximum(losses_unclipped, losses_clipped)
    dual_bound = -advantages * clip_ratio_c
    negative = advantages < 0
    pg_losses = torch.where(negative, torch.minimum(clip_losses, dual_bound), clip_losses)
    loss = inputs.aggregate(pg_losses)
    with torch.no_grad():
        mask = inputs.response_mask.bool()
        count = mask.sum().clamp(min=1)
        metrics = {
            "pg_clipfrac": ((losses_clipped > losses_unclipped) & mask).sum() / count,
            "pg_clipfrac_lower": ((clip_losses > dual_bound) & negative & mask).sum() / count,
            "ppo_kl": -masked_sum(log_ratio, mask) / count,
        }
    return loss, metrics


@policy_loss("gpg")
def compute_policy_loss_gpg(inputs: PolicyLossInputs) -> LossAndMetrics:
    """Plain policy gradient -A * log_prob (GPG; REINFORCE when paired with rollout IS weights).

    Inputs: see `PolicyLossInputs`; `old_log_prob` only feeds the `ppo_kl` metric.
    Returns (loss, {"ppo_kl"}).
    """
    loss = inputs.aggregate(-inputs.advantages * inputs.log_prob)
    with torch.no_grad():
        ppo_kl = inputs.mean(inputs.old_log_prob - inputs.log_prob)
    return loss, {"ppo_kl": ppo_kl.detach()}
