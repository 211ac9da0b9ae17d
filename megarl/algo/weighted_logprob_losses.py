"""Policy losses of the form -A * (weight) * log_prob: CISPO, DPPO (binary TV / binary KL) and DRO.

Shapes `[B, T]`; each returns `(loss, metrics)` like `policy_loss.py` and aggregates with
`loss_agg_mode`. The weights that multiply log_prob are stop-gradient: the gradient with respect to
log_prob_it is -A_it * weight_it (plus DRO's proximal term), which the tests check directly.
"""

from __future__ import annotations

import torch

from megarl.algo.policy_loss_inputs import (
    LossAndMetrics,
    PolicyLossInputs,
    clip_bounds,
    policy_loss,
)

_DPPO_SETTINGS = ("clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c")


@policy_loss("cispo", settings=("clip_ratio", "clip_ratio_low", "clip_ratio_high"))
def compute_policy_loss_cispo(
    inputs: PolicyLossInputs,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
) -> LossAndMetrics:
    """CISPO (MiniMax-M1, arXiv:2506.13585): clip the importance weight, not the update.

        r_it = exp(clamp(log_prob - old_log_prob, -20, 20))
        l_it = -sg[clip(r_it, 1 - clip_ratio_low, 1 + clip_ratio_high)] * A_it * log_prob_it
    Every token keeps a gradient (-A * clipped weight); none is dropped by the clip.

    Args:
        old_log_prob, log_prob, advantages, response_mask and the aggregation inputs: see
            `PolicyLossInputs`.
        clip_ratio, clip_ratio_low, clip_ratio_high: bounds of the weight (MiniMax-M1 uses no
            lower bound, i.e. a large clip_ratio_low).

    Returns:
        loss, metrics {"pg_clipfrac" (tokens whose weight was clipped), "pg_clipfrac_lower"
        (0, as verl), "ppo_kl"}.
    """
    low, high = clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    log_ratio = inputs.log_ratio()
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, 1.0 - low, 1.0 + high).detach()
    loss = inputs.aggregate(-weight * inputs.advantages * inputs.log_prob)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": inputs.mean((ratio != weight).to(ratio.dtype)),
            "pg_clipfrac_lower": ratio.new_zeros(()),
            "ppo_kl": inputs.mean(-log_ratio),
        }
    return loss, metrics


def _dppo_keep(divergence: str, inputs: PolicyLossInputs, low: float, high: float) -> torch.Tensor:
    """`[B, T]` 1.0 where a token stays inside DPPO's trust region, else 0.0 (no gradient)."""
    log_prob, old_log_prob = inputs.log_prob, inputs.old_log_prob
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
    return torch.where(inputs.advantages > 0, keep_up, keep_down).to(log_prob.dtype)


_DPPO_DOC = """DPPO-Binary-{name} (arXiv:2602.04879): a divergence trust region instead of the ratio clip.

        r_it   = exp(clamp(log_prob - old_log_prob, -20, 20)),  p = pi(y_t), p_old = pi_old(y_t)
        {rule}
        keep   = up where A > 0, else down         (stop-gradient; A = 0 gives 0 anyway)
        l_it   = -A_it * sg[min(r_it, clip_ratio_c)] * log_prob_it * keep_it
    A token whose update already left the trust region in the advantage's direction is dropped;
    the others get the truncated-IS policy gradient.

    Args:
        old_log_prob, log_prob, advantages, response_mask and the aggregation inputs: see
            `PolicyLossInputs`.
        clip_ratio, clip_ratio_low, clip_ratio_high: the divergence thresholds delta (verl reuses
            the actor's clip keys for them).
        clip_ratio_c: truncation bound of the IS weight (`actor.clip_ratio_c`, so 3.0 with
            verl's and megarl's default config; 20.0 only when the key is absent, as verl; the
            paper recommends a large bound).

    Returns:
        loss, metrics {{"pg_clipfrac" (dropped tokens), "pg_clipfrac_lower" (kept tokens whose
        ratio exceeds clip_ratio_c), "ppo_kl"}}.
    """


def _register_dppo(divergence: str, rule: str):
    """Register `dppo_<divergence>`: the DPPO loss with `_dppo_keep`'s trust region."""

    def dppo(
        inputs: PolicyLossInputs,
        clip_ratio: float = 0.2,
        clip_ratio_low: float | None = None,
        clip_ratio_high: float | None = None,
        clip_ratio_c: float = 20.0,
    ) -> LossAndMetrics:
        low, high = clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
        log_ratio = inputs.log_ratio()
        ratio = torch.exp(log_ratio)
        truncated = torch.clamp(ratio, max=clip_ratio_c).detach()
        with torch.no_grad():
            keep = _dppo_keep(divergence, inputs, low, high)
        loss = inputs.aggregate(-inputs.advantages * truncated * inputs.log_prob * keep)
        with torch.no_grad():
            metrics = {
                "pg_clipfrac": inputs.mean(1.0 - keep),
                "pg_clipfrac_lower": inputs.mean((ratio > clip_ratio_c) * keep),
                "ppo_kl": inputs.mean(-log_ratio),
            }
        return loss, metrics

    dppo.__name__ = dppo.__qualname__ = f"compute_policy_loss_dppo_{divergence}"
    dppo.__doc__ = _DPPO_DOC.format(name=divergence.upper(), rule=rule)
    return policy_loss(f"dppo_{divergence}", settings=_DPPO_SETTINGS)(dppo)


compute_policy_loss_dppo_tv = _register_dppo(
    "tv", rule="up = p - p_old <= clip_ratio_high,  down = p - p_old >= -clip_ratio_low"
)
compute_policy_loss_dppo_kl = _register_dppo(
    "kl",
    rule="D = p_old log(p_old / p) + (1 - p_old) log((1 - p_old + 1e-8) / (1 - p + 1e-8))\n"
    "        up = D <= clip_ratio_high or p <= p_old,  down = D <= clip_ratio_low or p >= p_old",
)


@policy_loss("dro", settings=("dro_beta",))
def compute_policy_loss_dro(
    inputs: PolicyLossInputs, dro_beta: float | None = None
) -> LossAndMetrics:
    """DRO (Direct Reward Optimization): policy gradient with a quadratic proximal penalty.

        l_it = -(A_it * log_prob_it - dro_beta / 2 * (log_prob_it - old_log_prob_it)^2)
    Gradient with respect to log_prob: -A + dro_beta * (log_prob - old_log_prob); the penalty
    applies at every valid token, advantage 0 included. No clamp (verl has none either).

    Args:
        old_log_prob, log_prob, advantages, response_mask and the aggregation inputs: see
            `PolicyLossInputs`.
        dro_beta: `policy_loss.dro_beta`, required and > 0.

    Returns:
        loss, metrics {"ppo_kl"}.
    """
    if dro_beta is None or not dro_beta > 0:
        raise ValueError(f"policy_loss.dro_beta must be > 0 for loss_mode dro, got {dro_beta}")
    log_ratio = inputs.log_prob - inputs.old_log_prob
    loss = inputs.aggregate(
        -(inputs.advantages * inputs.log_prob - 0.5 * dro_beta * log_ratio.square())
    )
    with torch.no_grad():
        metrics = {"ppo_kl": inputs.mean(-log_ratio)}
    return loss, metrics
