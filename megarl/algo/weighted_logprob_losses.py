"""Policy losses of the form -A * (weight) * log_prob: CISPO, DPPO (binary TV / binary KL) and DRO.

Shapes `[B, T]`; each returns `(loss, metrics)` like `policy_loss.py` and aggregates with
`loss_agg_mode`. The weights that multiply log_prob are stop-gradient: the gradient with respect to
log_prob_it is -A_it * weight_it (plus DRO's proximal term), which the tests check directly.
"""

from __future__ import annotations

import torch

from megarl.algo.log_ratio import clamp_log_ratio
from megarl.algo.masked import masked_mean
from megarl.algo.policy_loss import aggregate_policy_loss, clip_bounds
from megarl.algo.registry import POLICY_LOSSES

Counts = torch.Tensor | float | None


@POLICY_LOSSES.register("cispo")
def compute_policy_loss_cispo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    global_token_count: Counts = None,
    global_seq_count: Counts = None,
    loss_scale_factor: float | None = None,
    seq_token_counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, arXiv:2506.13585): clip the importance weight, not the update.

        r_it = exp(clamp(log_prob - old_log_prob, -20, 20))
        l_it = -sg[clip(r_it, 1 - clip_ratio_low, 1 + clip_ratio_high)] * A_it * log_prob_it
    Every token keeps a gradient (-A * clipped weight); none is dropped by the clip.

    Args:
        old_log_prob, log_prob, advantages, response_mask: `[B, T]`.
        clip_ratio, clip_ratio_low, clip_ratio_high: bounds of the weight (MiniMax-M1 uses no
            lower bound, i.e. a large clip_ratio_low).
        loss_agg_mode, rollout_is_weights, global_token_count, global_seq_count,
            loss_scale_factor, seq_token_counts: see `compute_policy_loss_vanilla`.

    Returns:
        loss, metrics {"pg_clipfrac" (tokens whose weight was clipped), "pg_clipfrac_lower"
        (0, as verl), "ppo_kl"}.
    """
    low, high = clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    log_ratio = clamp_log_ratio(log_prob - old_log_prob)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, 1.0 - low, 1.0 + high).detach()
    pg_losses = -weight * advantages * log_prob
    loss = aggregate_policy_loss(
        pg_losses,
        response_mask,
        loss_agg_mode,
        rollout_is_weights,
        global_token_count,
        global_seq_count,
        loss_scale_factor,
        seq_token_counts,
    )
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((ratio != weight).to(ratio.dtype), response_mask),
            "pg_clipfrac_lower": ratio.new_zeros(()),
            "ppo_kl": masked_mean(-log_ratio, response_mask),
        }
    return loss, metrics


def _dppo(
    divergence: str,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    low: float,
    high: float,
    clip_ratio_c: float,
    aggregation: dict,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    log_ratio = clamp_log_ratio(log_prob - old_log_prob)
    ratio = torch.exp(log_ratio)
    truncated = torch.clamp(ratio, max=clip_ratio_c).detach()
    with torch.no_grad():
        prob, old_prob = torch.exp(log_prob), torch.exp(old_log_prob)
        if divergence == "tv":
            keep_up = prob - old_prob <= high
            keep_down = prob - old_prob >= -low
        else:
            binary_kl = old_prob * (old_log_prob - log_prob) + (1.0 - old_prob) * torch.log(
                (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8)
            )
            keep_up = (binary_kl <= high) | (prob <= old_prob)
            keep_down = (binary_kl <= low) | (prob >= old_prob)
        keep = torch.where(advantages > 0, keep_up, keep_down).to(ratio.dtype)
    pg_losses = -advantages * truncated * log_prob * keep
    loss = aggregate_policy_loss(pg_losses, response_mask, **aggregation)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean(1.0 - keep, response_mask),
            "pg_clipfrac_lower": masked_mean((ratio > clip_ratio_c) * keep, response_mask),
            "ppo_kl": masked_mean(-log_ratio, response_mask),
        }
    return loss, metrics


_DPPO_DOC = """DPPO-Binary-{name} (arXiv:2602.04879): a divergence trust region instead of the ratio clip.

        r_it   = exp(clamp(log_prob - old_log_prob, -20, 20)),  p = pi(y_t), p_old = pi_old(y_t)
        {rule}
        keep   = up where A > 0, else down         (stop-gradient; A = 0 gives 0 anyway)
        l_it   = -A_it * sg[min(r_it, clip_ratio_c)] * log_prob_it * keep_it
    A token whose update already left the trust region in the advantage's direction is dropped;
    the others get the truncated-IS policy gradient.

    Args:
        old_log_prob, log_prob, advantages, response_mask: `[B, T]`.
        clip_ratio, clip_ratio_low, clip_ratio_high: the divergence thresholds delta (verl reuses
            the actor's clip keys for them).
        clip_ratio_c: truncation bound of the IS weight (`actor.clip_ratio_c`, so 3.0 with
            verl's and megarl's default config; 20.0 only when the key is absent, as verl; the
            paper recommends a large bound).
        loss_agg_mode, rollout_is_weights, global_token_count, global_seq_count,
            loss_scale_factor, seq_token_counts: see `compute_policy_loss_vanilla`.

    Returns:
        loss, metrics {{"pg_clipfrac" (dropped tokens), "pg_clipfrac_lower" (kept tokens whose
        ratio exceeds clip_ratio_c), "ppo_kl"}}.
    """


@POLICY_LOSSES.register("dppo_tv")
def compute_policy_loss_dppo_tv(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 20.0,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    global_token_count: Counts = None,
    global_seq_count: Counts = None,
    loss_scale_factor: float | None = None,
    seq_token_counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    low, high = clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    aggregation = {
        "loss_agg_mode": loss_agg_mode,
        "rollout_is_weights": rollout_is_weights,
        "global_token_count": global_token_count,
        "global_seq_count": global_seq_count,
        "loss_scale_factor": loss_scale_factor,
        "seq_token_counts": seq_token_counts,
    }
    return _dppo(
        "tv",
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        low,
        high,
        clip_ratio_c,
        aggregation,
    )


@POLICY_LOSSES.register("dppo_kl")
def compute_policy_loss_dppo_kl(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 20.0,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    global_token_count: Counts = None,
    global_seq_count: Counts = None,
    loss_scale_factor: float | None = None,
    seq_token_counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    low, high = clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    aggregation = {
        "loss_agg_mode": loss_agg_mode,
        "rollout_is_weights": rollout_is_weights,
        "global_token_count": global_token_count,
        "global_seq_count": global_seq_count,
        "loss_scale_factor": loss_scale_factor,
        "seq_token_counts": seq_token_counts,
    }
    return _dppo(
        "kl",
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        low,
        high,
        clip_ratio_c,
        aggregation,
    )


compute_policy_loss_dppo_tv.__doc__ = _DPPO_DOC.format(
    name="TV",
    rule="up = p - p_old <= clip_ratio_high,  down = p - p_old >= -clip_ratio_low",
)
compute_policy_loss_dppo_kl.__doc__ = _DPPO_DOC.format(
    name="KL",
    rule="D = p_old log(p_old / p) + (1 - p_old) log((1 - p_old + 1e-8) / (1 - p + 1e-8))\n"
    "        up = D <= clip_ratio_high or p <= p_old,  down = D <= clip_ratio_low or p >= p_old",
)


@POLICY_LOSSES.register("dro")
def compute_policy_loss_dro(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    dro_beta: float | None = None,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    global_token_count: Counts = None,
    global_seq_count: Counts = None,
    loss_scale_factor: float | None = None,
    seq_token_counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DRO (Direct Reward Optimization): policy gradient with a quadratic proximal penalty.

        l_it = -(A_it * log_prob_it - dro_beta / 2 * (log_prob_it - old_log_prob_it)^2)
    Gradient with respect to log_prob: -A + dro_beta * (log_prob - old_log_prob); the penalty
    applies at every valid token, advantage 0 included. No clamp (verl has none either).

    Args:
        old_log_prob, log_prob, advantages, response_mask: `[B, T]`.
        dro_beta: `policy_loss.dro_beta`, required and > 0.
        loss_agg_mode, rollout_is_weights, global_token_count, global_seq_count,
            loss_scale_factor, seq_token_counts: see `compute_policy_loss_vanilla`.

    Returns:
        loss, metrics {"ppo_kl"}.
    """
    if dro_beta is None or not dro_beta > 0:
        raise ValueError(f"policy_loss.dro_beta must be > 0 for loss_mode dro, got {dro_beta}")
    log_ratio = log_prob - old_log_prob
    pg_losses = -(advantages * log_prob - 0.5 * dro_beta * log_ratio.square())
    loss = aggregate_policy_loss(
        pg_losses,
        response_mask,
        loss_agg_mode,
        rollout_is_weights,
        global_token_count,
        global_seq_count,
        loss_scale_factor,
        seq_token_counts,
    )
    with torch.no_grad():
        metrics = {"ppo_kl": masked_mean(-log_ratio, response_mask)}
    return loss, metrics
