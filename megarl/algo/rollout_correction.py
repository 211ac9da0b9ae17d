"""Which log-probs anchor the PPO ratio, and importance weights for rollout/trainer mismatch.

The rollout engine (vLLM, often bf16) and the trainer (Megatron) give slightly different
log-probs for the same tokens. "decoupled" (default): the trainer recomputes old log-probs and the
ratio is pi_theta / pi_old, optionally with truncated IS weights pi_old / pi_rollout multiplying
the per-token loss. "bypass": the rollout log-probs are the old log-probs, so the PPO clip already
bounds the correction and PPO-clip takes no IS weights (they would count it twice). A loss without
a ratio (e.g. "gpg") can take token- or sequence-level IS weights in either mode.
"""

from __future__ import annotations

import torch

from megarl.algo.log_ratio import clamp_log_ratio
from megarl.algo.masked import masked_mean, masked_sum

ROLLOUT_LOG_PROB_MODES = ("decoupled", "bypass")
ROLLOUT_IS_LEVELS = ("token", "sequence")


def select_old_log_prob(
    mode: str,
    rollout_log_prob: torch.Tensor | None = None,
    recomputed_old_log_prob: torch.Tensor | None = None,
) -> torch.Tensor:
    """The `[B, T]` old log-probs anchoring the PPO ratio for `mode` ("decoupled" or "bypass")."""
    if mode == "decoupled":
        if recomputed_old_log_prob is None:
            raise ValueError("decoupled mode needs the trainer's recomputed old log-probs")
        return recomputed_old_log_prob
    if mode == "bypass":
        if rollout_log_prob is None:
            raise ValueError("bypass mode needs the rollout engine's log-probs")
        return rollout_log_prob
    raise ValueError(
        f"unknown rollout log-prob mode {mode!r}; valid names: " + ", ".join(ROLLOUT_LOG_PROB_MODES)
    )


@torch.no_grad()
def compute_rollout_is_weights(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str = "token",
    rollout_is_threshold: float = 2.0,
    rollout_is_batch_normalize: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated importance weights w = min(pi_old / pi_rollout, threshold), detached.

    Args:
        old_log_prob: `[B, T]` trainer log-probs (the recomputed old policy).
        rollout_log_prob: `[B, T]` log-probs reported by the rollout engine for the same tokens.
        response_mask: `[B, T]` binary.
        rollout_is: "token" (one weight per token) or "sequence" (exp of the masked sum of log
            ratios, one weight per sequence broadcast over its tokens).
        rollout_is_threshold: upper truncation bound (> 0).
        rollout_is_batch_normalize: rescale so that the mean weight over the batch (over tokens for
            "token", over non-empty sequences for "sequence") is 1. Local to this batch.

    Returns:
        weights `[B, T]` (0 at masked positions), metrics {"rollout_is_mean", "rollout_is_max",
        "rollout_is_clipped_frac"} computed before truncation, over the mask.
    """
    if rollout_is not in ROLLOUT_IS_LEVELS:
        raise ValueError(
            f"unknown rollout_is {rollout_is!r}; valid names: " + ", ".join(ROLLOUT_IS_LEVELS)
        )
    if rollout_is_threshold <= 0:
        raise ValueError(f"rollout_is_threshold must be > 0, got {rollout_is_threshold}")
    mask = response_mask.bool()
    log_ratio = old_log_prob - rollout_log_prob
    if rollout_is == "sequence":
        log_ratio = masked_sum(log_ratio, mask, dim=-1).unsqueeze(-1).expand_as(old_log_prob)
    raw = torch.exp(clamp_log_ratio(log_ratio))
    raw = torch.where(mask, raw, torch.zeros_like(raw))
    metrics = {
        "rollout_is_mean": masked_mean(raw, mask),
        "rollout_is_max": raw.max() if raw.numel() else raw.new_zeros(()),
        "rollout_is_clipped_frac": masked_mean((raw > rollout_is_threshold).float(), mask),
    }
    weights = raw.clamp(max=rollout_is_threshold)
    if rollout_is_batch_normalize:
        if rollout_is == "token":
            mean = masked_mean(weights, mask)
        else:
            seq_weight = masked_mean(weights, mask, dim=-1)
            non_empty = mask.any(dim=-1)
            mean = masked_mean(seq_weight, non_empty)
        weights = torch.where(mean > 1e-8, weights / mean.clamp(min=1e-8), weights)
    return weights, metrics
