"""The actor and critic updates: ``ppo_epochs`` × mini-batches × micro-batches in verl's units.

Mini-batch i is the same set of responses at every layout (:mod:`megarl.trainer.split`); each DP
rank trains on its share of it, and each micro-batch's loss is its share of the mini-batch's
(:mod:`megarl.trainer.losses`). Metrics: loss terms are the exact mini-batch values, token
means are token-weighted over the mini-batch, then both are averaged over mini-batches and
epochs (verl averages per micro-batch values, which weights small micro-batches more).
"""

from __future__ import annotations

import contextlib
import itertools
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megarl.algo import count_tokens_and_seqs, micro_batch_generator
from megarl.models.expert_load import ExpertLoad
from megarl.models.gpt import unwrap
from megarl.models.routing import Routing, agreement_over_world
from megarl.models.run_outputs import IDS_IN_TOPK, LOG_PROBS_AT_IDS, SCORE_IDS
from megarl.models.runner import forward_backward
from megarl.models.trainable import TrainableModel
from megarl.parallel.init import device
from megarl.trainer.batch import BATCH, StepBatch
from megarl.trainer.losses import (
    Counts,
    Distillation,
    finish_distillation_metrics,
    policy_loss,
    value_loss,
)
from megarl.trainer.split import dp_share, micro_batches, mini_batches, seeded_generator


@dataclass(frozen=True)
class MiniBatching:
    """How an update pass cuts the step's batch (verl's units), shared by actor and critic."""

    responses_per_mini_batch: int
    """ppo_mini_batch_size × rollout.n."""
    micro_batch_size: int | None = None
    """ppo_micro_batch_size_per_gpu (responses per DP rank); None with use_dynamic_bsz."""
    max_token_len: int | None = None
    """ppo_max_token_len_per_gpu (use_dynamic_bsz)."""
    ppo_epochs: int = 1
    shuffle: bool = False
    balance: bool = True
    """trainer.balance_batch: balance token counts over DP ranks within each mini-batch."""


@dataclass(frozen=True)
class PolicyUpdate(MiniBatching):
    """Everything the actor update needs from the config (``actor_rollout_ref.actor.*``)."""

    loss_mode: str = "vanilla"
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    temperature: float = 1.0
    policy_loss_kwargs: dict[str, Any] = field(default_factory=dict)
    """clip_ratio, clip_ratio_low/high, clip_ratio_c and each loss mode's own keys."""
    distillation: Distillation | None = None
    """On-policy distillation's loss settings (``distillation.enabled``), else None."""


@dataclass(frozen=True)
class ValueUpdate(MiniBatching):
    """The critic update's settings (``critic.*``)."""

    cliprange_value: float | None = 0.5
    loss_agg_mode: str = "token-mean"


@dataclass
class PolicyUpdateResult:
    """What the actor update returns."""

    metrics: dict[str, float]
    """``actor/*``."""
    current_log_probs: torch.Tensor | None = None
    """``[B, R]`` the update's own first forward's log-probs (the old ones under verl's
    shortcut: one mini-batch, one epoch), gathered over DP; None otherwise."""


def update_policy(
    actor: TrainableModel,
    batch: StepBatch,
    settings: PolicyUpdate,
    *,
    vocab_size: int,
    seed: int,
    step: int,
    old_are_current: bool = False,
) -> PolicyUpdateResult:
    """Run the actor update on ``batch`` (``advantages``, ``old_log_probs`` and, as set,
    ``ref_log_probs``, ``rollout_is_weights`` and the replayed ``routing``).

    ``old_are_current``: π_old is the current policy (verl's shortcut), taken from the update's
    own forward pass and returned as :attr:`PolicyUpdateResult.current_log_probs`."""
    if old_are_current and (
        settings.ppo_epochs != 1 or settings.responses_per_mini_batch != len(batch)
    ):
        raise ValueError("old_are_current needs exactly one mini-batch and one epoch")
    kept: list[torch.Tensor] = []  # the shortcut's one mini-batch's log-probs
    # Clip-Cov draws a random token subset: one generator per micro-batch, seeded by (seed, step,
    # index), the index unique over this step's micro-batches and DP ranks (TP/PP peers share it).
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    micro_count = itertools.count()

    def generator() -> torch.Generator:
        return micro_batch_generator(seed, step, next(micro_count) * dp_size + dp_rank,
                                     device=device())  # fmt: skip

    def make_loss_fn(tokens: float, seqs: float):
        counts = Counts.of(settings.loss_agg_mode, tokens, seqs, settings.loss_scale_factor)

        def loss_fn(outputs, mb):
            data: StepBatch = mb[BATCH]
            log_prob = outputs["log_probs"]
            width = log_prob.shape[1]
            cut = _cutter(width)
            return policy_loss(
                settings,
                counts,
                log_prob=log_prob,
                entropy=outputs["entropy"],
                old_log_prob=log_prob.detach() if old_are_current else cut(data.old_log_probs),
                advantages=cut(data.advantages),
                response_mask=cut(data.response_mask),
                ref_log_prob=cut(data.ref_log_probs),
                rollout_is_weights=cut(data.rollout_is_weights),
                generator=generator,
                teacher_log_prob=cut(data.teacher_log_probs),
                student_topk_log_prob=outputs.get(LOG_PROBS_AT_IDS),
                teacher_topk_log_prob=cut(data.teacher_topk_log_probs),
                ids_in_topk=outputs.get(IDS_IN_TOPK),
            )

        return loss_fn

    def keep(outputs: dict, mine: torch.Tensor) -> None:
        if old_are_current:
            width = batch.response_mask.shape[1]
            kept.append(_gather_rows(outputs["log_probs"], mine, len(batch), width))

    metrics = run_update(
        actor,
        batch,
        settings,
        make_loss_fn,
        seed=seed,
        step=step,
        purpose="actor",
        vocab_size=vocab_size,
        temperature=settings.temperature,
        keep=keep,
    )
    metrics = finish_distillation_metrics(metrics)
    return PolicyUpdateResult(
        {f"actor/{k}": v for k, v in metrics.items()}, kept[0] if kept else None
    )


def update_critic(
    critic: TrainableModel, batch: StepBatch, settings: ValueUpdate, *, seed: int, step: int
) -> dict[str, float]:
    """Run the critic update on ``batch`` (``values`` and ``returns`` set); returns
    ``critic/vf_loss``, ``critic/vf_clipfrac``, ``critic/vpred_mean``, ``critic/grad_norm``, ..."""

    def make_loss_fn(tokens: float, seqs: float):
        counts = Counts.of(settings.loss_agg_mode, tokens, seqs)

        def loss_fn(outputs, mb):
            data: StepBatch = mb[BATCH]
            vpreds = outputs["values"]
            cut = _cutter(vpreds.shape[1])
            return value_loss(settings, counts, vpreds=vpreds, returns=cut(data.returns),
                              values=cut(data.values), response_mask=cut(data.response_mask))  # fmt: skip

        return loss_fn

    metrics = run_update(critic, batch, settings, make_loss_fn, seed=seed, step=step,
                         purpose="critic")  # fmt: skip
    return {f"critic/{k}": v for k, v in metrics.items()}


def run_update(
    model: TrainableModel,
    batch: StepBatch,
    settings: MiniBatching,
    make_loss_fn: Callable[[float, float], Callable],
    *,
    seed: int,
    step: int,
    purpose: str,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    keep: Callable[[dict, torch.Tensor], None] | None = None,
) -> dict[str, float]:
    """``ppo_epochs`` × mini-batches of ``model``'s update: each mini-batch's loss comes from
    ``make_loss_fn(global_tokens, global_seqs)``, its gradient is reduced and stepped; returns
    metrics averaged over mini-batches (loss terms exact, token means token-weighted), the grad
    norm, skipped steps and the learning rate. With ``batch.routing`` set every forward replays
    it (R2 or R3), and ``router_agreement`` is the share of real tokens whose routers, choosing
    afresh, would have picked the same experts. A MoE model also reports its expert load over
    the first epoch's forwards (each token once: :mod:`megarl.models.expert_load`)."""
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    totals: dict[str, float] = defaultdict(float)
    count = 0
    agreement = torch.zeros(2, dtype=torch.float64)
    replay = batch.routing if purpose == "actor" else None
    moe = unwrap(model.chunks[0]).config.num_moe_experts  # every rank, MoE layers or not
    load = ExpertLoad(model.chunks) if moe else None
    balance_by = batch.lengths if settings.balance else None
    for epoch in range(settings.ppo_epochs):
        order = seeded_generator(seed, f"{purpose}-mini-batches", step, epoch)
        for indices in mini_batches(
            len(batch), settings.responses_per_mini_batch, shuffle=settings.shuffle, generator=order
        ):
            tokens, seqs = count_tokens_and_seqs(batch.response_mask[indices])
            mine = dp_share(indices, dp_rank, dp_size, balance_by)
            routing = Routing(model.chunks, "replay") if replay is not None else None
            if load is not None:
                load.replaying = routing
            micro = micro_batches(batch.lengths, indices, dp_rank, dp_size,
                                  micro_batch_size=settings.micro_batch_size,
                                  max_token_len=settings.max_token_len,
                                  balance=settings.balance,
                                  cp=parallel_state.get_context_parallel_world_size())  # fmt: skip
            sequences = batch.sequences(mine, loss_inputs=True, replay=replay)
            if purpose == "actor" and batch.teacher_topk_ids is not None:  # forward_kl_topk
                sequences.extra[SCORE_IDS] = batch.teacher_topk_ids[mine]
            with load if load is not None and epoch == 0 else contextlib.nullcontext():
                per_micro, outputs = forward_backward(
                    model.chunks,
                    sequences,
                    make_loss_fn(float(tokens), float(seqs)),
                    micro_batches=micro,
                    vocab_size=vocab_size,
                    temperature=temperature,
                    keep_outputs=True,
                    routing=routing,
                    pack=model.pack,
                )
            if routing is not None:
                agreement += torch.stack([routing.agree, routing.tokens])
            if keep is not None:
                keep(outputs, mine)
            sums = _sum_over_dp({k: sum(m[k] for m in per_micro) for k in per_micro[0]})
            result = model.step()
            for key, value in sums.items():
                totals[key] += value
            totals["grad_norm"] += result.grad_norm
            totals["skipped_steps"] += 0.0 if result.updated else 1.0
            count += 1
    metrics = {k: v / count for k, v in totals.items() if k != "skipped_steps"}
    metrics["skipped_steps"] = totals["skipped_steps"]
    metrics["lr"] = model.lr
    if replay is not None:  # every rank's routers: each pipeline stage's layers, each DP share
        metrics["router_agreement"] = agreement_over_world(agreement)
    if load is not None:
        metrics.update(load.metrics())
    return metrics


def _cutter(width: int) -> Callable[[torch.Tensor | None], torch.Tensor | None]:
    """Cuts ``[b, R]`` inputs to the micro-batch's own response width."""
    return lambda t: None if t is None else t[:, :width]


def _gather_rows(local: torch.Tensor, rows: torch.Tensor, n: int, width: int) -> torch.Tensor:
    """``[n, width]`` on every rank from each DP rank's ``local`` values of its ``rows``."""
    group = parallel_state.get_data_parallel_group()
    full = torch.zeros(n, width, dtype=local.dtype, device=device())
    full[rows.to(full.device), : local.shape[1]] = local.to(full.device)[:, :width]
    if dist.get_world_size(group) > 1:
        dist.all_reduce(full, group=group)  # the rows of different ranks are disjoint
    return full.cpu()


def _sum_over_dp(values: dict[str, float]) -> dict[str, float]:
    """Sum per-rank metric shares over the DP group (one all-reduce; the context-parallel peers
    of a DP rank hold the same sequences, so the same metrics)."""
    keys = sorted(values)
    group = parallel_state.get_data_parallel_group()
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=device())
    if dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return dict(zip(keys, t.cpu().tolist(), strict=True))
