"""KL-Cov and Clip-Cov (Cui et al. 2025, arXiv:2505.22617): PPO variants that single out the
tokens whose advantage and log-prob covary most, the ones that drive entropy collapse.

Shapes `[B, T]`; each returns `(loss, metrics)` like `policy_loss.py`. As in verl, both pick
tokens from statistics of the micro-batch they are given (means over its valid tokens, a budget
of ratio x its token count), so the result depends on how a mini-batch is split. Clip-Cov draws
a random subset from a `generator` seeded per micro-batch (`micro_batch_generator`). Unlike verl,
the log-ratio is clamped to +-20 before exp.
"""

from __future__ import annotations

import hashlib

import torch

from megarl.algo.policy_loss_inputs import (
    LossAndMetrics,
    PolicyLossInputs,
    clip_bounds,
    policy_loss,
)


def micro_batch_generator(
    seed: int, step: int, micro_batch_index: int, device: torch.device | str = "cpu"
) -> torch.Generator:
    """A generator seeded by (seed, step, micro_batch_index), for Clip-Cov's random subset.

    `micro_batch_index` must be unique within the step across DP ranks (e.g. rank x micro-batches
    per rank + local index). The three numbers are hashed, so nearby tuples give unrelated streams.
    """
    key = hashlib.blake2b(f"{seed}:{step}:{micro_batch_index}".encode(), digest_size=8).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(key, "little") >> 1)


def _covariance(inputs: PolicyLossInputs) -> torch.Tensor:
    """`[B, T]` (A - mean A)(log_prob - mean log_prob), means over the valid tokens (detached)."""
    advantages, log_prob = inputs.advantages, inputs.log_prob.detach()
    return (advantages - inputs.mean(advantages)) * (log_prob - inputs.mean(log_prob))


@policy_loss("kl_cov", settings=("kl_cov_ratio", "ppo_kl_coef"))
def compute_policy_loss_kl_cov(
    inputs: PolicyLossInputs, kl_cov_ratio: float = 0.0002, ppo_kl_coef: float = 0.1
) -> LossAndMetrics:
    """KL-Cov: unclipped policy gradient, plus a |log-ratio| penalty on the top-covariance tokens.

        r_it = exp(clamp(log_prob - old_log_prob, -20, 20))
        l_it = -A_it r_it + ppo_kl_coef * |log r_it|   for the k valid tokens of largest
                                                         covariance (A - mean A)(log_prob - mean)
        l_it = -A_it r_it                              for the others
    k = max(1, floor(kl_cov_ratio x valid tokens of this batch)); the order of ties is torch.topk's
    over the valid tokens in row-major order, as in verl. See the module docstring about the
    dependence on the micro-batch split.

    Args:
        old_log_prob, log_prob, advantages, response_mask and the aggregation inputs: see
            `PolicyLossInputs`.
        kl_cov_ratio: `policy_loss.kl_cov_ratio`, fraction of tokens penalised (> 0).
        ppo_kl_coef: `policy_loss.ppo_kl_coef`, weight of the |log-ratio| penalty.

    Returns:
        loss, metrics {"ppo_kl": mean |log-ratio| over the mask (verl reports this one here)}.
    """
    if not kl_cov_ratio > 0:
        raise ValueError(f"policy_loss.kl_cov_ratio must be > 0, got {kl_cov_ratio}")
    mask = inputs.response_mask.bool()
    log_ratio = inputs.log_ratio()
    pg_losses = -inputs.advantages * torch.exp(log_ratio)
    valid = torch.nonzero(mask.reshape(-1)).squeeze(-1)
    if valid.numel() > 0:
        covariance = _covariance(inputs).reshape(-1)[valid]
        k = max(1, int(valid.numel() * kl_cov_ratio))
        chosen = valid[torch.topk(covariance, k, largest=True).indices]
        penalised = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
        penalised[chosen] = True
        penalty = ppo_kl_coef * log_ratio.abs()
        pg_losses = torch.where(penalised.view_as(mask), pg_losses + penalty, pg_losses)
    loss = inputs.aggregate(pg_losses)
    with torch.no_grad():
        metrics = {"ppo_kl": inputs.mean(log_ratio.abs())}
    return loss, metrics


@policy_loss(
    "clip_cov",
    settings=(
        "generator",
        "clip_ratio",
        "clip_ratio_low",
        "clip_ratio_high",
        "clip_cov_ratio",
        "clip_cov_lb",
        "clip_cov_ub",
    ),
)
def compute_policy_loss_clip_cov(
    inputs: PolicyLossInputs,
    generator: torch.Generator | None = None,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_cov_ratio: float = 0.0002,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
) -> LossAndMetrics:
    """Clip-Cov: PPO clip, and no gradient for a random few tokens of high covariance.

        r_it   = exp(clamp(log_prob - old_log_prob, -20, 20))
        l_it   = max(-A r, -A clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high)) * corr_it
    corr_it = 0 for n tokens drawn uniformly (with `generator`) among the candidates: valid tokens
    the ratio clip leaves alone with clip_cov_lb < (A - mean A)(log_prob - mean log_prob) <
    clip_cov_ub; n = min(max(1, floor(clip_cov_ratio x valid tokens)), candidates). corr = 1
    elsewhere. See the module docstring about the dependence on the micro-batch split.

    Args:
        old_log_prob, log_prob, advantages, response_mask and the aggregation inputs: see
            `PolicyLossInputs`.
        generator: draws the random subset (required; see `micro_batch_generator`). verl uses the
            global torch RNG instead.
        clip_ratio, clip_ratio_low, clip_ratio_high: the PPO clip range.
        clip_cov_ratio, clip_cov_lb, clip_cov_ub: `policy_loss.clip_cov_*`.

    Returns:
        loss, metrics {"pg_clipfrac": fraction of valid tokens with corr = 0 (verl's name for
        it), "ppo_kl"}.
    """
    if generator is None:
        raise ValueError(
            "clip_cov draws a random subset of tokens: pass `generator`, seeded by (seed, step, "
            "micro-batch index), e.g. megarl.algo.micro_batch_generator(seed, step, index)"
        )
    if not clip_cov_ratio > 0:
        raise ValueError(f"policy_loss.clip_cov_ratio must be > 0, got {clip_cov_ratio}")
    low, high = clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    mask = inputs.response_mask.bool()
    log_ratio = inputs.log_ratio()
    ratio = torch.exp(log_ratio)
    unclipped = -inputs.advantages * ratio
    clipped = -inputs.advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    with torch.no_grad():
        covariance = _covariance(inputs)
        candidates = (
            mask & ~(clipped > unclipped) & (covariance > clip_cov_lb) & (covariance < clip_cov_ub)
        )
        flat = torch.nonzero(candidates.reshape(-1)).squeeze(-1)
        budget = max(1, int(int(mask.sum()) * clip_cov_ratio))
        order = torch.randperm(flat.numel(), generator=generator, device=generator.device)
        dropped = flat[order[: min(budget, flat.numel())].to(flat.device)]
        corr = torch.ones(mask.numel(), dtype=ratio.dtype, device=ratio.device)
        corr[dropped] = 0.0
        corr = corr.view_as(ratio)
    pg_losses = torch.maximum(unclipped, clipped) * corr
    loss = inputs.aggregate(pg_losses)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": inputs.mean((corr == 0).to(ratio.dtype)),
            "ppo_kl": inputs.mean(-log_ratio),
        }
    return loss, metrics
