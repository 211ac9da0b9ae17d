"""The actor update: ``ppo_epochs`` × mini-batches × micro-batches in verl's units.

Mini-batch membership comes from global response indices (a permutation seeded by (seed, step,
epoch) when ``shuffle``), so mini-batch i is the same set of responses at every layout; each DP
rank trains on its share of it (:func:`megarl.trainer.batch.dp_share`). The loss of a micro-batch
is its *share* of the mini-batch loss: every term is aggregated with the mini-batch's global
token and sequence counts (known on every rank, since every rank holds the whole batch), which
is the contract :func:`megarl.models.runner.forward_backward` turns into exact gradients.

Loss = policy loss (``policy_loss.loss_mode``) − entropy_coeff · entropy + kl_loss_coef · KL(π‖π_ref)
(``use_kl_loss``), each aggregated with ``loss_agg_mode`` (verl's actor does the same).

Metrics: the loss terms are reported as the exact mini-batch values (the shares summed over
micro-batches and DP ranks); ``pg_clipfrac``, ``ppo_kl`` and friends as global token-weighted
means over the mini-batch; then averaged over mini-batches and epochs. (verl averages per
micro-batch values instead, which weights small micro-batches more.)
"""

from __future__ import annotations

import contextlib
import itertools
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megarl.algo import (
    POLICY_LOSSES,
    agg_loss,
    compute_policy_loss,
    count_tokens_and_seqs,
    kl_penalty,
    micro_batch_generator,
)
from megarl.models.expert_load import ExpertLoad
from megarl.models.gpt import unwrap
from megarl.models.routing import ROUTING, Routing, agreement_over_world
from megarl.models.runner import forward_backward
from megarl.models.trainable import TrainableModel
from megarl.parallel.init import device
from megarl.trainer.batch import (
    RolloutTensors,
    dp_share,
    mini_batches,
    seeded_generator,
    token_budget_micro_batches,
)


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


_TOKEN_MEANS = ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "vf_clipfrac")


def update_policy(
    actor: TrainableModel,
    batch: RolloutTensors,
    settings: PolicyUpdate,
    *,
    vocab_size: int,
    seed: int,
    step: int,
    old_log_probs: str = "old_log_probs",
) -> dict[str, float]:
    """Run the actor update on ``batch`` (which holds ``advantages``, ``old_log_probs`` and, as
    needed, ``ref_log_probs`` / ``rollout_is_weights`` in its fields); returns ``actor/*``.

    ``old_log_probs="current"``: the old log-probs are the current ones (one mini-batch, one
    epoch, decoupled, no IS weights: verl's shortcut), taken from the update's own forward pass;
    they are then stored, gathered over DP, in ``batch.fields["recomputed_log_probs"]``.
    """
    current = old_log_probs == "current"
    if current and (settings.ppo_epochs != 1 or settings.responses_per_mini_batch != len(batch)):
        raise ValueError("old_log_probs='current' needs exactly one mini-batch and one epoch")
    names = ["advantages"] if current else ["advantages", old_log_probs]
    if settings.use_kl_loss:
        names.append("ref_log_probs")
    if "rollout_is_weights" in batch.fields:
        names.append("rollout_is_weights")
    # router_replay R2 (recorded by the old-log-prob pass, so absent with the shortcut) or R3.
    replay = ROUTING in batch.fields
    if replay:
        names.append(ROUTING)

    def keep(outputs: dict, mine: torch.Tensor) -> None:
        if current:
            batch.fields["recomputed_log_probs"] = _gather_rows(
                outputs["log_probs"], mine, len(batch), batch.response_mask.shape[1]
            )

    # Clip-Cov draws a random token subset: one generator per micro-batch, seeded by (seed, step,
    # index), the index unique over this step's micro-batches and DP ranks (TP/PP peers share it).
    dp_rank = parallel_state.get_data_parallel_rank(with_context_parallel=True)
    dp_size = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    micro_count = itertools.count()

    def generator() -> torch.Generator:
        index = next(micro_count) * dp_size + dp_rank
        return micro_batch_generator(seed, step, index, device=device())

    metrics = run_update(
        actor,
        batch,
        settings,
        names,
        lambda tokens, seqs: _loss_fn(settings, tokens, seqs, old_log_probs, generator),
        seed=seed,
        step=step,
        purpose="actor",
        vocab_size=vocab_size,
        temperature=settings.temperature,
        keep=keep,
        replay_routing=replay,
    )
    return {f"actor/{k}": v for k, v in metrics.items()}


def run_update(
    model: TrainableModel,
    batch: RolloutTensors,
    settings: MiniBatching,
    names: list[str],
    make_loss_fn,
    *,
    seed: int,
    step: int,
    purpose: str,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    keep=None,
    replay_routing: bool = False,
) -> dict[str, float]:
    """``ppo_epochs`` × mini-batches of ``model``'s update: each mini-batch's loss comes from
    ``make_loss_fn(global_tokens, global_seqs)``, its gradient is reduced and stepped; returns
    metrics averaged over mini-batches (loss terms exact, token means token-weighted), the grad
    norm, skipped steps and the learning rate. ``replay_routing``: every forward replays the
    batch's MoE routing (R2: recorded; R3: the rollout's), and ``router_agreement`` is the share of real tokens
    whose routers, choosing afresh, would have picked the same experts. A MoE model also reports
    its expert load over the first epoch's forwards (each token once:
    :mod:`megarl.models.expert_load`)."""
    dp_rank = parallel_state.get_data_parallel_rank(with_context_parallel=True)
    dp_size = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    totals: dict[str, float] = defaultdict(float)
    count = 0
    agreement = torch.zeros(2, dtype=torch.float64)
    moe = unwrap(model.chunks[0]).config.num_moe_experts  # every rank, MoE layers or not
    load = ExpertLoad(model.chunks) if moe else None
    for epoch in range(settings.ppo_epochs):
        order = seeded_generator(seed, f"{purpose}-mini-batches", step, epoch)
        for indices in mini_batches(
            len(batch), settings.responses_per_mini_batch, shuffle=settings.shuffle, generator=order
        ):
            tokens, seqs = count_tokens_and_seqs(batch.response_mask[indices])
            lengths = batch.lengths if settings.balance else None
            mine = dp_share(indices, dp_rank, dp_size, lengths)
            routing = Routing(model.chunks, "replay") if replay_routing else None
            with load if load is not None and epoch == 0 else contextlib.nullcontext():
                per_micro, outputs = forward_backward(
                    model.chunks,
                    batch.sequences(mine, names),
                    make_loss_fn(float(tokens), float(seqs)),
                    micro_batches=_micro_batches(batch, indices, mine, settings, dp_size),
                    vocab_size=vocab_size,
                    temperature=temperature,
                    keep_outputs=True,
                    routing=routing,
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
    if replay_routing:  # every rank's routers: each pipeline stage's layers, each DP share
        metrics["router_agreement"] = agreement_over_world(agreement)
    if load is not None:
        metrics.update(load.metrics())
    return metrics


def _micro_batches(
    batch: RolloutTensors,
    indices: torch.Tensor,
    mine: torch.Tensor,
    settings: MiniBatching,
    dp_size: int,
) -> int | list[torch.Tensor]:
    if settings.max_token_len is None:
        return settings.micro_batch_size  # type: ignore[return-value]
    balance_by = batch.lengths if settings.balance else None
    # Every DP rank uses the same number of micro-batches: the largest any share needs.
    most = max(
        len(
            token_budget_micro_batches(
                batch.lengths[dp_share(indices, r, dp_size, balance_by)], settings.max_token_len
            )
        )
        for r in range(dp_size)
    )
    return token_budget_micro_batches(
        batch.lengths[mine], settings.max_token_len, num_micro_batches=most
    )


def _loss_fn(settings: PolicyUpdate, tokens: float, seqs: float, old_name: str, generator=None):
    """The micro-batch loss: its share of the mini-batch loss, and metric shares that add up to
    the mini-batch's values over micro-batches and DP ranks."""
    if settings.loss_agg_mode == "seq-mean-token-sum-norm" and settings.loss_scale_factor is None:
        # agg_loss would fall back to this micro-batch's padded width, which changes with the
        # layout and the step; the trainer passes the response length (setup.policy_update).
        raise ValueError("seq-mean-token-sum-norm needs a constant loss_scale_factor")
    counts = {
        "loss_agg_mode": settings.loss_agg_mode,
        "global_token_count": max(tokens, 1.0),
        "global_seq_count": max(seqs, 1.0),
        "loss_scale_factor": settings.loss_scale_factor,
    }
    # The names megarl.config.algo_inputs lists; validation checked the loss's declared needs.
    uncut = {"seq_token_counts": None}  # no sequence is split across context-parallel ranks

    def loss_fn(outputs, mb):
        log_prob = outputs["log_probs"]
        width = log_prob.shape[1]
        mask = mb["response_mask"][:, :width]
        old = log_prob.detach() if old_name == "current" else mb[old_name][:, :width]
        own = {}
        if "generator" in POLICY_LOSSES.inputs(settings.loss_mode):  # clip_cov's token subset
            if generator is None:
                raise ValueError(f"{settings.loss_mode} needs a generator")
            own["generator"] = generator()
        pg_loss, pg_metrics = compute_policy_loss(
            settings.loss_mode,
            old_log_prob=old,
            log_prob=log_prob,
            advantages=mb["advantages"][:, :width],
            response_mask=mask,
            rollout_is_weights=(
                mb["rollout_is_weights"][:, :width] if "rollout_is_weights" in mb else None
            ),
            **counts,
            **uncut,
            **settings.policy_loss_kwargs,
            **own,
        )
        loss = pg_loss
        weight = mask.sum() / counts["global_token_count"]
        metrics = {"pg_loss": pg_loss.detach()}
        metrics.update({k: v.detach() * weight for k, v in pg_metrics.items() if k in _TOKEN_MEANS})
        entropy = agg_loss(outputs["entropy"], mask, **counts)
        metrics["entropy"] = entropy.detach()
        if settings.entropy_coeff:
            loss = loss - settings.entropy_coeff * entropy
        if settings.use_kl_loss:
            kld = kl_penalty(log_prob, mb["ref_log_probs"][:, :width], settings.kl_loss_type)
            kl_loss = agg_loss(kld, mask, **counts)
            loss = loss + settings.kl_loss_coef * kl_loss
            metrics["kl_loss"] = kl_loss.detach()
        metrics["loss"] = loss.detach()
        return loss, metrics

    return loss_fn


def _gather_rows(local: torch.Tensor, rows: torch.Tensor, n: int, width: int) -> torch.Tensor:
    """``[n, width]`` on every rank from each DP rank's ``local`` values of its ``rows``."""
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    full = torch.zeros(n, width, dtype=local.dtype, device=device())
    full[rows.to(full.device), : local.shape[1]] = local.to(full.device)[:, :width]
    if dist.get_world_size(group) > 1:
        dist.all_reduce(full, group=group)  # the rows of different ranks are disjoint
    return full.cpu()


def _sum_over_dp(values: dict[str, float]) -> dict[str, float]:
    """Sum per-rank metric shares over the DP (×CP) group (one all-reduce)."""
    keys = sorted(values)
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=device())
    if dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return dict(zip(keys, t.cpu().tolist(), strict=True))
