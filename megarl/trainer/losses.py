"""The update's objectives: a micro-batch's share of the actor's and the critic's mini-batch loss.

Every term is aggregated with the mini-batch's global token and sequence counts (every rank
holds the whole batch, so it knows them), so the shares add up over micro-batches and DP ranks
to the mini-batch's loss: the contract :func:`megarl.models.runner.forward_backward` turns into
exact gradients. Metric shares add up the same way (token means weighted by the micro-batch's
share of the tokens).

Actor: policy loss (``policy_loss.loss_mode``) − entropy_coeff · entropy + kl_loss_coef ·
KL(π‖π_ref) (``use_kl_loss``), each aggregated with ``loss_agg_mode``, as verl's actor; with
on-policy distillation (:class:`Distillation`) verl's combination with the distillation loss.
Critic: ``megarl.algo.compute_value_loss``, clipped by ``cliprange_value``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megarl.algo import POLICY_LOSSES, agg_loss, compute_policy_loss, compute_value_loss, kl_penalty
from megarl.algo.distillation import (
    TOPK_LOSS_MODES,
    combined_loss,
    distillation_advantages,
    distillation_token_losses,
    topk_mass,
    topk_overlap,
)

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


@dataclass(frozen=True)
class Distillation:
    """``distillation.distillation_loss.*`` as the actor's loss uses it: the estimator modes
    read the teacher's sampled-token log-probs, ``forward_kl_topk`` the teacher's top-k and the
    student's log-probs at those ids (the update's forward: ``LOG_PROBS_AT_IDS``)."""

    loss_mode: str = "k3"
    log_prob_min_clamp: float | None = None
    use_task_rewards: bool = True
    distillation_loss_coef: float = 1.0
    loss_max_clamp: float | None = None
    use_policy_gradient: bool = False
    clip_ratio: float = 0.2
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2

    @classmethod
    def from_config(cls, loss) -> Distillation:
        """From a :class:`megarl.config.schema_distill.DistillationLossConfig`."""
        return cls(**{f: getattr(loss, f) for f in cls.__dataclass_fields__})


def distillation_loss(
    settings: Distillation,
    counts: Counts,
    *,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    teacher_log_prob: torch.Tensor | None,
    response_mask: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
    clip_ratio_c: float = 3.0,
    student_topk_log_prob: torch.Tensor | None = None,
    teacher_topk_log_prob: torch.Tensor | None = None,
    ids_in_topk: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The micro-batch's share of the distillation loss: the per-token divergence to the teacher
    (:func:`megarl.algo.distillation.distillation_token_losses`) aggregated by
    ``loss_agg_mode`` (supervised), or, with ``use_policy_gradient``, the vanilla clipped policy
    loss with advantage = −divergence and the distillation section's clip ratios (the actor's
    dual-clip bound and rollout importance weights, as its own policy loss). The top-k mode
    reads ``student_topk_log_prob`` and ``teacher_topk_log_prob`` ``[b, R, k]`` (and
    ``ids_in_topk``, which of the teacher's ids are in the student's own top-k, for verl's
    overlap metrics).

    Metrics, each a token mean as the others: ``distillation/loss``, ``divergence``, the top-k
    mode's ``{student,teacher}_mass`` and ``overlap_ratio``, and the clamps' shares,
    ``loss_clamp_fraction`` (response tokens whose loss ``loss_max_clamp`` cut) and
    ``log_prob_clamp_fraction`` (the student's top-k log-probs under ``log_prob_min_clamp``,
    which get no gradient); ``overlap_token_advantage`` (over the tokens with an overlap) is
    put together from two shares by :func:`finish_distillation_metrics`."""
    topk = settings.loss_mode in TOPK_LOSS_MODES
    if teacher_log_prob is None or (topk and teacher_topk_log_prob is None):
        raise ValueError("on-policy distillation needs the teacher's log-probs in the batch")
    if topk and student_topk_log_prob is None:
        raise ValueError(f"loss_mode={settings.loss_mode} needs the student's log-probs at the "
                         "teacher's top-k ids (the update's score_ids extra)")  # fmt: skip
    agg = counts.as_kwargs()
    raw = distillation_token_losses(settings.loss_mode, student_log_probs=log_prob,
                                    teacher_log_probs=teacher_log_prob,
                                    student_topk_log_probs=student_topk_log_prob,
                                    teacher_topk_log_probs=teacher_topk_log_prob,
                                    log_prob_min_clamp=settings.log_prob_min_clamp)  # fmt: skip
    c = settings.loss_max_clamp
    tokens = raw if c is None else raw.clamp(-c, c)
    if not settings.use_policy_gradient:
        share = agg_loss(tokens, response_mask, **agg)
    else:
        share, _ = compute_policy_loss(
            "vanilla",
            old_log_prob=old_log_prob,
            log_prob=log_prob,
            advantages=distillation_advantages(tokens),
            response_mask=response_mask,
            rollout_is_weights=rollout_is_weights,
            seq_token_counts=None,
            clip_ratio_c=clip_ratio_c,
            clip_ratio=settings.clip_ratio,
            clip_ratio_low=settings.clip_ratio_low,
            clip_ratio_high=settings.clip_ratio_high,
            **agg,
        )
    weight = response_mask.sum() / counts.global_token_count
    divergence = (tokens.detach() * response_mask).sum() / max(float(response_mask.sum()), 1.0)
    metrics = {"distillation/loss": share.detach(), "distillation/divergence": divergence * weight}
    if topk:  # verl's student_mass / teacher_mass: the probability on the teacher's top-k
        for name, values in (
            ("student", student_topk_log_prob),
            ("teacher", teacher_topk_log_prob),
        ):
            mass = (topk_mass(values) * response_mask).sum() / max(float(response_mask.sum()), 1.0)
            metrics[f"distillation/{name}_mass"] = mass * weight
    share_of = _token_share(response_mask, counts.global_token_count)
    if c is not None:
        metrics["distillation/loss_clamp_fraction"] = share_of(raw.detach().abs() > c)
    if topk and settings.log_prob_min_clamp is not None:
        floor = student_topk_log_prob.detach() < settings.log_prob_min_clamp
        metrics["distillation/log_prob_clamp_fraction"] = share_of(floor.float().mean(dim=-1))
    if topk and ids_in_topk is not None:
        ratio, advantage = topk_overlap(student_topk_log_prob, teacher_topk_log_prob, ids_in_topk,
                                        settings.log_prob_min_clamp)  # fmt: skip
        overlapping = (ratio > 0).to(ratio.dtype)
        metrics["distillation/overlap_ratio"] = share_of(ratio)
        metrics[_OVERLAP_ADVANTAGE] = share_of(advantage * overlapping)
        metrics[_OVERLAPPING] = share_of(overlapping)
    return share, metrics


_OVERLAP_ADVANTAGE = "distillation/_overlap_advantage_share"
_OVERLAPPING = "distillation/_overlapping_share"


def _token_share(response_mask: torch.Tensor, global_tokens: float):
    """``values`` `[b, R]` summed over this micro-batch's response tokens / the mini-batch's
    tokens: summed over micro-batches, the token mean (the other metrics' weighting)."""

    def share(values: torch.Tensor) -> torch.Tensor:
        return (values.detach().to(response_mask.dtype) * response_mask).sum() / global_tokens

    return share


def finish_distillation_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """The update's metrics with verl's ``distillation/overlap_token_advantage``: the mean over
    the response tokens where teacher and student top-k overlap (the ratio of its two shares,
    each averaged over mini-batches alike); the shares removed."""
    if _OVERLAPPING not in metrics:
        return metrics
    out = {k: v for k, v in metrics.items() if k not in (_OVERLAP_ADVANTAGE, _OVERLAPPING)}
    overlapping = metrics[_OVERLAPPING]
    out["distillation/overlap_token_advantage"] = (
        metrics[_OVERLAP_ADVANTAGE] / overlapping if overlapping else 0.0
    )
    return out


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
    teacher_log_prob: torch.Tensor | None = None,
    student_topk_log_prob: torch.Tensor | None = None,
    teacher_topk_log_prob: torch.Tensor | None = None,
    ids_in_topk: torch.Tensor | None = None,
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
    distill = getattr(settings, "distillation", None)
    if distill is not None:  # verl: the task's loss + coef x this, or this alone
        share, distill_metrics = distillation_loss(
            distill, counts, log_prob=log_prob, old_log_prob=old_log_prob,
            teacher_log_prob=teacher_log_prob, response_mask=response_mask,
            rollout_is_weights=rollout_is_weights,
            clip_ratio_c=settings.policy_loss_kwargs.get("clip_ratio_c", 3.0),
            student_topk_log_prob=student_topk_log_prob,
            teacher_topk_log_prob=teacher_topk_log_prob,
            ids_in_topk=ids_in_topk,
        )  # fmt: skip
        loss = combined_loss(loss, share, use_task_rewards=distill.use_task_rewards,
                             distillation_loss_coef=distill.distillation_loss_coef)  # fmt: skip
        metrics.update(distill_metrics)
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
