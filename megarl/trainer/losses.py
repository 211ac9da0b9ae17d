"""The update's objectives: a micro-batch's share of the actor's and the critic's mini-batch loss.

Every term is aggregated with the mini-batch's global token and sequence counts (every rank
holds the whole batch, so it knows them), so the shares add up over micro-batches and DP ranks
to the mini-batch's loss: the contract :func:`megarl.models.runner.forward_backward` turns into
exact gradients. Metric shares add up the same way (token means weighted by the micro-batch's
share of the tokens).

Actor: policy loss (``policy_loss.loss_mode``) − entropy_coeff · entropy + kl_loss_coef ·
KL(π‖π_ref) (``use_kl_loss``), each aggregated with ``loss_agg_mode``, as verl's actor.
Critic: ``megarl.algo.compute_value_loss``, clipped by ``cliprange_value``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megarl.algo import POLICY_LOSSES, agg_loss, compute_policy_loss, compute_value_loss, kl_penalty

TOKEN_MEANS = ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "vf_clipfrac")
"""Policy-loss metrics that are token means (reported token-weighted over the mini-batch)."""


@dataclass(frozen=True)
class Counts:
    """The mini-batch's global counts every term is aggregated with."""

    loss_agg_mode: str
    global_token_count: float
    global_seq_count: float
    loss_scale_factor: float | None = None

    @classmethod
    def of(cls, mode: str, tokens: float, seqs: float, scale: float | None = None) -> Counts:
        """At least 1 of each (an empty mini-batch aggregates to 0, not NaN)."""
        return cls(mode, max(tokens, 1.0), max(seqs, 1.0), scale)

    def as_kwargs(self) -> dict:
        return {
            "loss_agg_mode": self.loss_agg_mode,
            "global_token_count": self.global_token_count,
            "global_seq_count": self.global_seq_count,
            "loss_scale_factor": self.loss_scale_factor,
        }


def policy_loss(
    settings,
    counts: Counts,
    *,
    log_prob: torch.Tensor,
    entropy: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    ref_log_prob: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    generator: Callable[[], torch.Generator] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The actor's share and metric shares for one micro-batch, every tensor ``[b, R]``.

    ``settings``: :class:`megarl.trainer.update.PolicyUpdate`; ``generator``: a fresh generator
    for a loss mode that draws (Clip-Cov's token subset)."""
    if settings.loss_agg_mode == "seq-mean-token-sum-norm" and settings.loss_scale_factor is None:
        # agg_loss would fall back to this micro-batch's padded width, which changes with the
        # layout and the step; the trainer passes the response length (setup.policy_update).
        raise ValueError("seq-mean-token-sum-norm needs a constant loss_scale_factor")
    agg = counts.as_kwargs()
    own = {}
    if "generator" in POLICY_LOSSES.inputs(settings.loss_mode):
        if generator is None:
            raise ValueError(f"{settings.loss_mode} needs a generator")
        own["generator"] = generator()
    pg_loss, pg_metrics = compute_policy_loss(
        settings.loss_mode,
        old_log_prob=old_log_prob,
        log_prob=log_prob,
        advantages=advantages,
        response_mask=response_mask,
        rollout_is_weights=rollout_is_weights,
        seq_token_counts=None,  # no sequence is split across context-parallel ranks
        **agg,
        **settings.policy_loss_kwargs,
        **own,
    )
    loss = pg_loss
    weight = response_mask.sum() / counts.global_token_count
    metrics = {"pg_loss": pg_loss.detach()}
    metrics.update({k: v.detach() * weight for k, v in pg_metrics.items() if k in TOKEN_MEANS})
    entropy_term = agg_loss(entropy, response_mask, **agg)
    metrics["entropy"] = entropy_term.detach()
    if settings.entropy_coeff:
        loss = loss - settings.entropy_coeff * entropy_term
    if settings.use_kl_loss:
        kl_loss = agg_loss(kl_penalty(log_prob, ref_log_prob, settings.kl_loss_type),
                           response_mask, **agg)  # fmt: skip
        loss = loss + settings.kl_loss_coef * kl_loss
        metrics["kl_loss"] = kl_loss.detach()
    metrics["loss"] = loss.detach()
    return loss, metrics


def value_loss(
    settings,
    counts: Counts,
    *,
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The critic's share and metric shares for one micro-batch, every tensor ``[b, R]``
    (``settings``: :class:`megarl.trainer.update.ValueUpdate`)."""
    agg = counts.as_kwargs()
    agg.pop("loss_scale_factor")
    loss, metrics = compute_value_loss(vpreds, returns, values, response_mask,
                                       cliprange_value=settings.cliprange_value, **agg)  # fmt: skip
    weight = response_mask.sum() / counts.global_token_count
    return loss, {
        "vf_loss": loss.detach(),
        "vf_clipfrac": metrics["vf_clipfrac"] * weight,
        "vpred_mean": (vpreds.detach() * response_mask).sum() / counts.global_token_count,
    }
