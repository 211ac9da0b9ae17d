"""Policy losses with sequence-level structure: GSPO, SAPO and GMPO (`geo_mean`).

Shapes `[B, T]`; each returns `(loss, metrics)` like `policy_loss.py`. As in verl 0.9.1, gspo
aggregates with `actor.loss_agg_mode`, while sapo always uses seq-mean-token-mean and geo_mean a
mean over sequences (config validation warns when `loss_agg_mode` says otherwise). GSPO and GMPO
average log-ratios over whole sequences, so under context parallelism every rank must hold whole
sequences.
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

# GSPO clamps the log of its token-level sequence ratio from above (as verl): exp(10) ~ 2.2e4.
_GSPO_LOG_RATIO_MAX = 10.0
# The aggregation inputs of sapo, which always aggregates with seq-mean-token-mean.
_SEQ_MEAN_TOKEN_MEAN = ("rollout_is_weights", "global_seq_count", "seq_token_counts")


@policy_loss("gspo", settings=("clip_ratio", "clip_ratio_low", "clip_ratio_high"))
def compute_policy_loss_gspo(
    inputs: PolicyLossInputs,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
) -> LossAndMetrics:
    """GSPO (Zheng et al. 2025, arXiv:2507.18071): PPO clip on a sequence-level ratio.

        s_i     = exp(mean over valid t of (log_prob - old_log_prob))     (length-normalised)
        s_it    = exp(min(sg[log s_i] + log_prob_it - sg[log_prob_it], 10))   (= s_i in value)
        l_it    = max(-A_it s_it, -A_it clip(s_it, 1 - clip_ratio_low, 1 + clip_ratio_high))
    Every token of sequence i carries the value s_i and the gradient s_i * d log_prob_it (the
    paper's GSPO-token form). Aggregated with `loss_agg_mode` (verl 0.9.1 passes it through; the
    GSPO paper's own choice is seq-mean-token-mean).

    Args:
        old_log_prob, log_prob, advantages, response_mask and the aggregation inputs: see
            `PolicyLossInputs`.
        clip_ratio, clip_ratio_low, clip_ratio_high: the clip range (GSPO recipes use small
            values, e.g. 3e-4 / 4e-4).

    Returns:
        loss, metrics {"pg_clipfrac" (tokens where the clipped term wins), "pg_clipfrac_lower"
        (always 0, as verl), "ppo_kl"}.
    """
    low, high = clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    mask = inputs.response_mask.bool()
    log_prob, advantages = inputs.log_prob, inputs.advantages
    log_ratio = log_prob - inputs.old_log_prob
    lengths = mask.sum(dim=-1).clamp(min=1).to(log_ratio.dtype)
    seq_log_ratio = masked_sum(log_ratio, mask, dim=-1) / lengths  # [B]
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    seq_ratio = torch.exp(torch.clamp(token_log_ratio, max=_GSPO_LOG_RATIO_MAX))
    unclipped = -advantages * seq_ratio
    clipped = -advantages * torch.clamp(seq_ratio, 1.0 - low, 1.0 + high)
    loss = inputs.aggregate(torch.maximum(unclipped, clipped))
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": inputs.mean((clipped > unclipped).to(log_ratio.dtype)),
            "pg_clipfrac_lower": log_ratio.new_zeros(()),
            "ppo_kl": inputs.mean(-log_ratio),
        }
    return loss, metrics


@policy_loss("sapo", settings=("tau_pos", "tau_neg"), takes=_SEQ_MEAN_TOKEN_MEAN)
def compute_policy_loss_sapo(
    inputs: PolicyLossInputs, tau_pos: float = 1.0, tau_neg: float = 1.05
) -> LossAndMetrics:
    """SAPO (arXiv:2511.20347): a soft, temperature-controlled gate instead of the hard clip.

        r_it = exp(clamp(log_prob - old_log_prob, -20, 20))
        tau  = tau_pos where A > 0, else tau_neg
        l_it = -A_it * f(r_it),   f(r) = sigmoid(tau (r - 1)) * 4 / tau
    f(1) = 2 / tau and f'(r) = 4 sigmoid (1 - sigmoid): the gradient is the on-policy one at r = 1
    and fades smoothly as r leaves 1. Aggregated with seq-mean-token-mean (verl forces it).

    Args:
        old_log_prob, log_prob, advantages, response_mask, rollout_is_weights,
            global_seq_count, seq_token_counts: see `PolicyLossInputs`.
        tau_pos, tau_neg: `actor.tau_pos` / `actor.tau_neg` (> 0; the paper: tau_neg > tau_pos).

    Returns:
        loss, metrics {"pg_clipfrac", "pg_clipfrac_lower" (both 0: nothing is clipped, as verl),
        "ppo_kl"}.
    """
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"SAPO needs tau_pos, tau_neg > 0, got {tau_pos}, {tau_neg}")
    log_ratio = inputs.log_ratio()
    ratio = torch.exp(log_ratio)
    tau = torch.where(inputs.advantages > 0, tau_pos, tau_neg).to(ratio.dtype)
    gates = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    loss = inputs.aggregate(-gates * inputs.advantages, "seq-mean-token-mean")
    with torch.no_grad():
        zero = log_ratio.new_zeros(())
        metrics = {
            "pg_clipfrac": zero,
            "pg_clipfrac_lower": zero.clone(),
            "ppo_kl": inputs.mean(-log_ratio),
        }
    return loss, metrics


@policy_loss(
    "geo_mean",
    settings=("clip_ratio", "clip_ratio_low", "clip_ratio_high"),
    takes=("rollout_is_weights", "global_seq_count"),
)
def compute_policy_loss_geo_mean(
    inputs: PolicyLossInputs,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
) -> LossAndMetrics:
    """GMPO (arXiv:2507.20673): the geometric mean of token ratios, clipped per token in log space.

        d_it  = clamp(log_prob - old_log_prob, -20, 20)
        d'_it = min(d, clamp(d, -low, high)) where A > 0, max(...) where A < 0, 0 where A = 0
        l_i   = -mean_t(A_it) * exp(mean_t(d'_it))       (means over the valid tokens of i)
        loss  = sum_i l_i / N_seq
    A token's log-ratio is clipped only in the direction the advantage pushes it, so it gets no
    gradient exactly when its ratio left [1 - low, 1 + high] that way. verl supports sequence-level
    advantages only (mean_t A is the sequence's advantage); so does this. IS weights enter as
    their geometric mean per sequence, exp(mean_t log(w_it + 1e-10)), as verl.

    Deliberate differences from verl: megarl clamps d to +-20 (verl leaves it unclamped; identical
    unless a ratio exceeds e^20), averages over max(T_i, 1) valid tokens (verl: T_i + 1e-8), and
    divides by N_seq, the (global) number of non-empty sequences, where verl takes the mean over
    the rows of the micro-batch (empty rows included, no global count): exact under
    micro-batching here.

    Args:
        old_log_prob, log_prob, advantages, response_mask, rollout_is_weights: see
            `PolicyLossInputs`.
        clip_ratio, clip_ratio_low, clip_ratio_high: the log-space clip range (GMPO: 0.4 both).
        global_seq_count: N_seq over the mini-batch (default: this batch's non-empty rows).

    Returns:
        loss, metrics {"pg_clipfrac" / "pg_clipfrac_lower": fraction of tokens whose log-ratio
        lies outside the clip range with A > 0 / A < 0, "ppo_kl"}.
    """
    low, high = clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    mask, advantages = inputs.response_mask.bool(), inputs.advantages
    log_ratio = inputs.log_ratio()
    bounded = torch.clamp(log_ratio, -low, high)
    sign = torch.sign(advantages)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * bounded)
    lengths = mask.sum(dim=-1).clamp(min=1).to(log_ratio.dtype)
    seq_ratio = torch.exp(masked_sum(pessimistic, mask, dim=-1) / lengths)
    seq_advantage = masked_sum(advantages, mask, dim=-1) / lengths
    seq_losses = -seq_advantage * seq_ratio
    if inputs.rollout_is_weights is not None:
        log_weights = torch.log(inputs.rollout_is_weights + 1e-10)
        seq_losses = seq_losses * torch.exp(masked_sum(log_weights, mask, dim=-1) / lengths)
    global_seq_count = inputs.global_seq_count
    if global_seq_count is None:
        global_seq_count = mask.any(dim=-1).sum().clamp(min=1)
    loss = seq_losses.sum() / global_seq_count
    with torch.no_grad():
        outside = (log_ratio != bounded).to(log_ratio.dtype)
        metrics = {
            "pg_clipfrac": inputs.mean(outside * (advantages > 0)),
            "pg_clipfrac_lower": inputs.mean(outside * (advantages < 0)),
            "ppo_kl": inputs.mean(-log_ratio),
        }
    return loss, metrics
