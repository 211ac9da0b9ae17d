"""Critic loss with value clipping, and token entropy (the entropy bonus)."""

from __future__ import annotations

import torch

from megarl.algo.aggregation import agg_loss
from megarl.algo.masked import masked_mean


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float | None = None,
    loss_agg_mode: str = "token-mean",
    global_token_count: torch.Tensor | float | None = None,
    global_seq_count: torch.Tensor | float | None = None,
    loss_scale_factor: float | None = None,
    seq_token_counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss 0.5 * agg(max((v - R)^2, (clip(v, V_old +- c) - R)^2)).

    Args:
        vpreds: `[B, T]` values predicted by the critic being trained (carry the gradient).
        returns: `[B, T]` targets (advantages + old values from GAE).
        values: `[B, T]` old values, the centre of the clip window.
        response_mask: `[B, T]` binary.
        cliprange_value: `critic.cliprange_value` c; None disables clipping.
        loss_agg_mode, global_token_count, global_seq_count, loss_scale_factor, seq_token_counts:
            see `agg_loss`.

    Returns:
        loss (scalar), {"vf_clipfrac": fraction of tokens where the clipped term is larger}.
    """
    losses = (vpreds - returns) ** 2
    if cliprange_value is not None:
        clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
        clipped_losses = (clipped - returns) ** 2
        clipfrac = masked_mean((clipped_losses > losses).float(), response_mask).detach()
        losses = torch.maximum(losses, clipped_losses)
    else:
        clipfrac = vpreds.new_zeros(())
    loss = 0.5 * agg_loss(
        losses,
        response_mask,
        loss_agg_mode,
        global_token_count=global_token_count,
        global_seq_count=global_seq_count,
        loss_scale_factor=loss_scale_factor,
        seq_token_counts=seq_token_counts,
    )
    return loss, {"vf_clipfrac": clipfrac}


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Categorical entropy `[B, T]` from logits `[B, T, V]` (already divided by the temperature).

    H = logsumexp(z) - sum softmax(z) * z, computed stably in the logits' dtype.
    """
    log_norm = torch.logsumexp(logits, dim=-1)
    probs = torch.softmax(logits, dim=-1)
    return log_norm - (probs * logits).sum(dim=-1)


def compute_entropy_loss(
    logits: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    global_token_count: torch.Tensor | float | None = None,
    global_seq_count: torch.Tensor | float | None = None,
    loss_scale_factor: float | None = None,
    seq_token_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Aggregated entropy of `[B, T, V]` logits; the actor loss subtracts entropy_coeff * this."""
    return agg_loss(
        entropy_from_logits(logits),
        response_mask,
        loss_agg_mode,
        global_token_count=global_token_count,
        global_seq_count=global_seq_count,
        loss_scale_factor=loss_scale_factor,
        seq_token_counts=seq_token_counts,
    )
