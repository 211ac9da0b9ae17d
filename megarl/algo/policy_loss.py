"""Policy-gradient losses (`actor.policy_loss.loss_mode`): PPO clip with clip-higher and dual-clip,
and GPG. The rest of verl 0.9.1's menu lives beside this module: `sequence_losses.py` (gspo, sapo,
geo_mean), `weighted_logprob_losses.py` (cispo, dppo_tv, dppo_kl, dro) and `covariance_losses.py`
(kl_cov, clip_cov).

Every loss takes `[B, T]` tensors and returns `(loss, metrics)`: a scalar aggregated with
`agg_loss` (pass the global counts when micro-batching, see `aggregation.py`) and a dict of detached
0-dim tensors (no `.item()`, so no device sync; the trainer converts them). Rollout IS weights
(`rollout_is_weights`, `[B, T]`, detached) multiply the per-token loss before aggregation, in every
loss.
"""

from __future__ import annotations

import torch

from megarl.algo.aggregation import agg_loss
from megarl.algo.log_ratio import clamp_log_ratio
from megarl.algo.masked import masked_mean, masked_sum
from megarl.algo.registry import POLICY_LOSSES


@POLICY_LOSSES.register("vanilla")
def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    global_token_count: torch.Tensor | float | None = None,
    global_seq_count: torch.Tensor | float | None = None,
    loss_scale_factor: float | None = None,
    seq_token_counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (arXiv:1707.06347), DAPO clip-higher and dual-clip (arXiv:1912.09729).

        ratio = exp(clamp(log_prob - old_log_prob, -20, 20))
        l1 = -A * ratio,  l2 = -A * clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
        l  = max(l1, l2);  where A < 0: l = min(l, -A * clip_ratio_c)
    Worked example (seed 003, §3.5): log-probs -1.5 (new) vs -2.0 (old), A = 0.5, eps = 0.2:
    ratio = 1.65, l1 = -0.825, l2 = -0.6, loss = -0.6.

    Args:
        old_log_prob: `[B, T]` log-probs of the proximal policy (recomputed old log-probs in
            decoupled mode, rollout log-probs in bypass mode; see `rollout_correction.py`).
        log_prob: `[B, T]` log-probs of the policy being trained (carries the gradient).
        advantages: `[B, T]`.
        response_mask: `[B, T]` binary.
        clip_ratio: eps, used for either side not given separately.
        clip_ratio_low, clip_ratio_high: eps_low / eps_high (clip-higher: eps_high > eps_low).
        clip_ratio_c: dual-clip bound c > 1 for negative advantages.
        loss_agg_mode, global_token_count, global_seq_count, loss_scale_factor, seq_token_counts:
            see `agg_loss`.
        rollout_is_weights: optional `[B, T]` truncated importance weights pi_old / pi_rollout
            (detached) multiplying the per-token loss (decoupled mode's rollout correction).

    Returns:
        loss (scalar), metrics {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"}: fraction of tokens
        where the ratio clip is active, fraction of tokens with A < 0 where the dual clip is active,
        and the mean of old_log_prob - log_prob (clamped), all over the mask.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (dual-clip PPO), got {clip_ratio_c}")
    low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high

    log_ratio = clamp_log_ratio(log_prob - old_log_prob)
    ratio = torch.exp(log_ratio)
    losses_unclipped = -advantages * ratio
    losses_clipped = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    clip_losses = torch.maximum(losses_unclipped, losses_clipped)
    dual_bound = -advantages * clip_ratio_c
    negative = advantages < 0
    pg_losses = torch.where(negative, torch.minimum(clip_losses, dual_bound), clip_losses)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights

    loss = agg_loss(
        pg_losses,
        response_mask,
        loss_agg_mode,
        global_token_count=global_token_count,
        global_seq_count=global_seq_count,
        loss_scale_factor=loss_scale_factor,
        seq_token_counts=seq_token_counts,
    )
    with torch.no_grad():
        mask = response_mask.bool()
        count = mask.sum().clamp(min=1)
        metrics = {
            "pg_clipfrac": ((losses_clipped > losses_unclipped) & mask).sum() / count,
            "pg_clipfrac_lower": ((clip_losses > dual_bound) & negative & mask).sum() / count,
            "ppo_kl": -masked_sum(log_ratio, mask) / count,
        }
    return loss, metrics


@POLICY_LOSSES.register("gpg")
def compute_policy_loss_gpg(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    global_token_count: torch.Tensor | float | None = None,
    global_seq_count: torch.Tensor | float | None = None,
    loss_scale_factor: float | None = None,
    seq_token_counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Plain policy gradient -A * log_prob (GPG; REINFORCE when paired with rollout IS weights).

    Shapes `[B, T]`; `old_log_prob` only feeds the `ppo_kl` metric. Returns (loss, {"ppo_kl"}).
    """
    pg_losses = -advantages * log_prob
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    loss = agg_loss(
        pg_losses,
        response_mask,
        loss_agg_mode,
        global_token_count=global_token_count,
        global_seq_count=global_seq_count,
        loss_scale_factor=loss_scale_factor,
        seq_token_counts=seq_token_counts,
    )
    with torch.no_grad():
        ppo_kl = masked_mean(old_log_prob - log_prob, response_mask)
    return loss, {"ppo_kl": ppo_kl.detach()}


def aggregate_policy_loss(
    pg_losses: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    rollout_is_weights: torch.Tensor | None,
    global_token_count: torch.Tensor | float | None,
    global_seq_count: torch.Tensor | float | None,
    loss_scale_factor: float | None,
    seq_token_counts: torch.Tensor | None,
) -> torch.Tensor:
    """`[B, T]` per-token losses times the rollout IS weights (if any), aggregated by `agg_loss`."""
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    return agg_loss(
        pg_losses,
        response_mask,
        loss_agg_mode,
        global_token_count=global_token_count,
        global_seq_count=global_seq_count,
        loss_scale_factor=loss_scale_factor,
        seq_token_counts=seq_token_counts,
    )


def clip_bounds(
    clip_ratio: float, clip_ratio_low: float | None, clip_ratio_high: float | None
) -> tuple[float, float]:
    """(low, high): `clip_ratio_low/high`, each defaulting to `clip_ratio`."""
    low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    return low, high
