"""On-policy distillation losses (verl 0.9.1's ``distillation.distillation_loss.*``).

The student samples; a teacher scores every sampled token; the student minimises a divergence
to the teacher on its own samples. Two kinds of per-token loss, both `[B, T]`, unmasked:

- ``forward_kl_topk``: KL(teacher || student) over the teacher's top-k tokens at each position,
  sum_k q_k (log q_k - log p_k), with q the teacher's and p the student's probabilities at the
  teacher's top-k ids. Neither side is renormalised over the k tokens (verl's truncation), so the
  sum can be negative and is clamped at 0 (``clamp_min(0)``). The student's log-probs at those
  ids come from its full-vocabulary log-softmax (vocab-parallel at TP > 1:
  :func:`megarl.models.topk_logprobs.vocab_parallel_log_probs_at`, which does the TP reduction).
- the reverse-KL estimators ``kl/k1/abs/mse/k2/low_var_kl/k3`` of KL(student || teacher) on the
  sampled token, from the two log-probs of that token: :func:`megarl.algo.kl.kl_penalty` with
  the student as the policy and the teacher as the reference (the same estimators as the KL loss).

Then ``loss_max_clamp`` clamps every mode's per-token loss to [-c, c], and the loss trains either
supervised (aggregated by ``loss_agg_mode``: :func:`distillation_loss`) or as a reward
(advantage = -loss through the clipped policy loss: :func:`distillation_advantages`).
"""

from __future__ import annotations

import torch

from megarl.algo.aggregation import agg_loss
from megarl.algo.kl import kl_penalty

TOPK_LOSS_MODES = ("forward_kl_topk",)
"""Modes scored over the teacher's top-k (the others: one log-prob per sampled token)."""
ESTIMATOR_LOSS_MODES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
"""Reverse-KL estimators on the sampled token (verl 0.9.1's registered names)."""


def forward_kl_topk(
    student_topk_log_probs: torch.Tensor,
    teacher_topk_log_probs: torch.Tensor,
    log_prob_min_clamp: float | None = None,
) -> torch.Tensor:
    """KL(teacher || student) over the teacher's top-k, truncated, clamped at 0.

    loss = max(0, sum_k exp(t_k) (t_k - s_k)) with t = teacher, s = student log-probs at the
    teacher's top-k ids; with ``log_prob_min_clamp`` = m both are clamped below first
    (t_k = max(t_k, m), s_k = max(s_k, m): a student log-prob under m gets no gradient).
    Computed in at least float32 (float64 stays float64).

    Args:
        student_topk_log_probs: `[B, T, K]` the student's log-softmax over the full vocabulary,
            at the teacher's top-k ids (differentiable).
        teacher_topk_log_probs: `[B, T, K]` the teacher's top-k log-probs (a constant).
        log_prob_min_clamp: floor of both log-probs; None: no floor.

    Returns:
        `[B, T]` per-token loss, >= 0.
    """
    if student_topk_log_probs.shape != teacher_topk_log_probs.shape:
        raise ValueError(
            "student and teacher top-k log-probs must both be [B, T, K]; got "
            f"{tuple(student_topk_log_probs.shape)} and {tuple(teacher_topk_log_probs.shape)}"
        )
    dtype = torch.promote_types(student_topk_log_probs.dtype, torch.float32)
    s = student_topk_log_probs.to(dtype)
    t = teacher_topk_log_probs.detach().to(dtype)
    if log_prob_min_clamp is not None:
        s = s.clamp_min(log_prob_min_clamp)
        t = t.clamp_min(log_prob_min_clamp)
    return (t.exp() * (t - s)).sum(dim=-1).clamp_min(0.0)


def topk_mass(topk_log_probs: torch.Tensor) -> torch.Tensor:
    """Probability mass on the top-k ids, sum_k exp(log p_k): `[B, T, K]` -> `[B, T]` (verl's
    ``student_mass`` / ``teacher_mass``, before any clamp; no gradient)."""
    return topk_log_probs.detach().exp().sum(dim=-1)


def topk_overlap(
    student_topk_log_probs: torch.Tensor,
    teacher_topk_log_probs: torch.Tensor,
    in_student_topk: torch.Tensor,
    log_prob_min_clamp: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's top-k overlap diagnostics (arXiv:2604.13016), per position, no gradient.

    ``in_student_topk`` `[B, T, K]` 1/0 marks the teacher's top-k ids that are also among the
    student's own top k. Returns ``(ratio, advantage)``, each `[B, T]`: the overlap's share of k,
    and the mean over the overlapping ids of -exp(t_k) (t_k - s_k) (the log-probs clamped below
    at ``log_prob_min_clamp`` first, as the loss; 0 where none overlap)."""
    shared = in_student_topk.detach().to(torch.promote_types(in_student_topk.dtype, torch.float32))
    s = student_topk_log_probs.detach().to(shared.dtype)
    t = teacher_topk_log_probs.detach().to(shared.dtype)
    if log_prob_min_clamp is not None:
        s, t = s.clamp_min(log_prob_min_clamp), t.clamp_min(log_prob_min_clamp)
    count = shared.sum(dim=-1)
    advantage = (-(t.exp() * (t - s)) * shared).sum(dim=-1) / count.clamp_min(1.0)
    return count / shared.shape[-1], advantage


def reverse_kl_estimate(
    student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, loss_mode: str
) -> torch.Tensor:
    """Single-sample estimate of KL(student || teacher) at the sampled token, `[B, T]`.

    d = student - teacher log-prob: kl/k1 = d; abs = |d|; mse/k2 = d^2 / 2;
    low_var_kl/k3 = r - log r - 1 with r = exp(-d) (log r clamped to +-20, the result to
    [-10, 10], as verl). Estimators from :mod:`megarl.algo.kl`.

    Args:
        student_log_probs: `[B, T]` the student's log-prob of each sampled token (differentiable).
        teacher_log_probs: `[B, T]` the teacher's log-prob of the same token (a constant).
        loss_mode: one of :data:`ESTIMATOR_LOSS_MODES`.
    """
    if loss_mode not in ESTIMATOR_LOSS_MODES:
        raise ValueError(
            f"unknown reverse-KL loss_mode {loss_mode!r}; valid: " + ", ".join(ESTIMATOR_LOSS_MODES)
        )
    return kl_penalty(student_log_probs, teacher_log_probs.detach(), loss_mode)


def distillation_token_losses(
    loss_mode: str,
    *,
    student_log_probs: torch.Tensor | None = None,
    teacher_log_probs: torch.Tensor | None = None,
    student_topk_log_probs: torch.Tensor | None = None,
    teacher_topk_log_probs: torch.Tensor | None = None,
    log_prob_min_clamp: float | None = None,
    loss_max_clamp: float | None = None,
) -> torch.Tensor:
    """The per-token distillation loss `[B, T]` of ``loss_mode``, then clamped to
    [-loss_max_clamp, loss_max_clamp] when that is set (verl clamps both ends: k1 can be < 0).

    forward_kl_topk reads the `[B, T, K]` top-k inputs (and ``log_prob_min_clamp``); the
    estimators read the `[B, T]` sampled-token ones.
    """
    if loss_mode in TOPK_LOSS_MODES:
        if student_topk_log_probs is None or teacher_topk_log_probs is None:
            raise ValueError(f"loss_mode={loss_mode} needs the [B, T, K] top-k log-probs")
        losses = forward_kl_topk(student_topk_log_probs, teacher_topk_log_probs, log_prob_min_clamp)
    else:
        if student_log_probs is None or teacher_log_probs is None:
            raise ValueError(f"loss_mode={loss_mode} needs the sampled tokens' [B, T] log-probs")
        losses = reverse_kl_estimate(student_log_probs, teacher_log_probs, loss_mode)
    if loss_max_clamp is not None:
        losses = losses.clamp(-loss_max_clamp, loss_max_clamp)
    return losses


def distillation_loss(
    token_losses: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    **counts,
) -> torch.Tensor:
    """Supervised mode (``use_policy_gradient=false``): the `[B, T]` per-token losses
    aggregated over the response tokens by ``loss_agg_mode``
    (:func:`megarl.algo.aggregation.agg_loss`; ``counts``: its global counts under
    micro-batching). Returns a scalar."""
    return agg_loss(token_losses, response_mask, loss_agg_mode, **counts)


def distillation_advantages(token_losses: torch.Tensor) -> torch.Tensor:
    """Policy-gradient mode (``use_policy_gradient=true``): advantage = -loss per token, `[B, T]`,
    detached (fed to the vanilla clipped policy loss with the distillation section's clip ratios)."""
    return -token_losses.detach()


def combined_loss(
    policy_loss: torch.Tensor | float,
    distill_loss: torch.Tensor,
    *,
    use_task_rewards: bool,
    distillation_loss_coef: float = 1.0,
) -> torch.Tensor:
    """The actor's loss, as verl: policy_loss + coef * distill_loss with the task rewards
    (``use_task_rewards``), else distill_loss alone (coef 1, the task's policy loss dropped)."""
    if use_task_rewards:
        return policy_loss + distillation_loss_coef * distill_loss
    return distill_loss
