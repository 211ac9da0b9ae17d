"""Passes over the whole step batch: generation and log-prob passes, each returning global tensors.

Generation: every rank holds the step's global prompt list; the engine's replicas split it and
every rank gets every response back (:func:`megarl.rollout.distribute.generate_distributed`
with one "training shard", the global list). Log-prob passes: each DP rank computes its
contiguous share of the batch and the shares are all-gathered over the DP group, so the result
is the same global ``[B, R]`` tensor on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from megatron.core import parallel_state

from megarl.data import PromptSample
from megarl.models.routing import (
    ROLLOUT_ROUTING,
    ROUTING,
    Routing,
    agreement_over_world,
    pad_positions,
    rollout_routing,
)
from megarl.models.runner import compute_log_probs
from megarl.parallel.collectives import all_gather_tensors
from megarl.parallel.init import device
from megarl.rollout.base import RolloutBatch, RolloutEngine
from megarl.rollout.distribute import generate_distributed
from megarl.trainer.batch import RolloutTensors, dp_share, rollout_tensors


def generate(
    engine: RolloutEngine,
    prompts: Sequence[PromptSample],
    *,
    n: int,
    sampling: dict[str, Any],
    seed: int,
    step: int,
    pad_token_id: int,
) -> tuple[RolloutTensors, RolloutBatch]:
    """``n`` responses to each prompt, prompt-major, as global tensors on every rank."""
    out = generate_distributed(
        engine,
        [list(p.prompt_ids) for p in prompts],
        dp_rank=0,
        dp_size=1,
        n=n,
        seed=seed,
        step=step,
        **sampling,
    )
    tensors = rollout_tensors(
        [s.prompt_token_ids for s in out],
        [s.response_token_ids for s in out],
        [s.response_logprobs for s in out],
        [s.prompt_id for s in out],
        [s.finish_reason == "length" for s in out],
        pad_token_id=pad_token_id,
    )
    if len(out) and out.samples[0].routing is not None:  # captured for R3
        width = tensors.input_ids.shape[1]
        tensors.fields[ROLLOUT_ROUTING] = rollout_routing([s.routing for s in out], width)
    return tensors, out


def prefetch(
    engine: Any,
    prompts: Sequence[PromptSample],
    requests: Sequence[tuple[int, dict[str, Any], dict | None]],
    *,
    seed: int,
    step: int,
) -> None:
    """Ask a remote engine (:meth:`~megarl.rollout.remote_engine.RemoteEngine.prefetch`) for
    the batches later :func:`generate` calls with these arguments take, one per request
    ``(n, sampling, reward)``: the requests that
    :func:`~megarl.rollout.distribute.generate_distributed` makes of the engine's one replica
    (a later request that differs is asked for anew)."""
    tokens = [list(p.prompt_ids) for p in prompts]
    ids = list(range(len(prompts)))
    engine.prefetch(
        [
            (tokens, {"prompt_ids": ids, "n": n, "seed": seed, "step": step, **sampling}, reward)
            for n, sampling, reward in requests
        ]
    )


def global_log_probs(
    chunks: Sequence[torch.nn.Module],
    batch: RolloutTensors,
    *,
    vocab_size: int,
    temperature: float,
    micro_batches: int | None,
    max_token_len: int | None = None,
    sum_pi_squared: bool = False,
    routing: Routing | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Log-probs, entropy and (when asked) sum_v pi^2, ``[B, R]`` for every response token of
    the batch, on every rank. ``routing``: a replaying :class:`Routing`, fed the batch's
    ``ROUTING`` field."""
    out = global_pass(
        chunks,
        batch,
        "actor",
        micro_batches=micro_batches,
        max_token_len=max_token_len,
        vocab_size=vocab_size,
        temperature=temperature,
        sum_pi_squared=sum_pi_squared,
        routing=routing,
    )
    return out["log_probs"], out["entropy"], out.get("sum_pi_squared")


def global_pass(
    chunks: Sequence[torch.nn.Module],
    batch: RolloutTensors,
    role: str,
    *,
    micro_batches: int | None,
    max_token_len: int | None = None,
    **kwargs: Any,
) -> dict[str, torch.Tensor]:
    """A forward-only pass over the whole batch: each DP rank computes its contiguous share and
    the shares are all-gathered, so every rank gets every output ``[B, R]``. A replaying
    ``routing`` (in ``kwargs``) is fed the batch's ``ROUTING`` field."""
    from megarl.models.runner import compute_values
    from megarl.trainer.batch import token_budget_micro_batches

    dp_rank = parallel_state.get_data_parallel_rank(with_context_parallel=True)
    dp_size = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    everyone = torch.arange(len(batch))
    rows = dp_share(everyone, dp_rank, dp_size)
    replaying = kwargs.get("routing") is not None and kwargs["routing"].mode == "replay"
    sequences = batch.sequences(rows, (ROUTING,) if replaying else ())
    if max_token_len is not None:
        most = max(
            len(token_budget_micro_batches(batch.lengths[dp_share(everyone, r, dp_size)],
                                           max_token_len))
            for r in range(dp_size)
        )  # fmt: skip
        micro: Any = token_budget_micro_batches(
            batch.lengths[rows], max_token_len, num_micro_batches=most
        )
    else:
        micro = fitting_micro_batch(len(rows), micro_batches or len(rows))
    routing = None
    if role == "critic":
        outputs = {"values": compute_values(chunks, sequences, micro_batches=micro)}
    else:
        out = compute_log_probs(chunks, sequences, micro_batches=micro, **kwargs)
        outputs = {"log_probs": out.log_probs, "entropy": out.entropy}
        if out.sum_pi_squared is not None:
            outputs["sum_pi_squared"] = out.sum_pi_squared
        routing = out.routing
    width = batch.response_mask.shape[1]
    gathered = {k: gather_dp(_pad_to(v, width), dp_size) for k, v in outputs.items()}
    if routing is not None:  # every position of every sequence, this pipeline rank's layers
        local = pad_positions(routing, batch.input_ids.shape[1]).int()  # NCCL, gloo: no int16
        gathered[ROUTING] = gather_dp(local, dp_size).to(routing.dtype)
    return gathered


def fitting_micro_batch(rows: int, size: int) -> int:
    """The configured micro-batch size, lowered to a divisor of the rows (forward-only passes
    accept any split)."""
    size = max(1, min(size, rows))
    while rows % size:
        size -= 1
    return size


def _pad_to(t: torch.Tensor, width: int) -> torch.Tensor:
    if t.shape[1] >= width:
        return t[:, :width]
    return torch.nn.functional.pad(t, (0, width - t.shape[1]))


def gather_dp(local: torch.Tensor, dp_size: int) -> torch.Tensor:
    """Every DP rank's equal-sized ``local`` rows, concatenated in DP-rank order (on the CPU)."""
    if dp_size == 1:
        return local.cpu()
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    return torch.cat(all_gather_tensors(local.to(device()), group)).cpu()


def old_log_probs_are_current(run, num_responses: int) -> bool:
    """verl's shortcut: one mini-batch, one epoch, decoupled mode, no IS weights, no KL in the
    reward and no estimator reading the old log-probs: they equal the current ones."""
    correction = run.cfg.algorithm.rollout_correction
    return (
        run.policy.ppo_epochs == 1
        and run.policy.responses_per_mini_batch == num_responses
        and not correction.bypass_mode
        and correction.rollout_is is None
        and not run.cfg.actor_rollout_ref.actor.calculate_sum_pi_squared
        and not run.cfg.algorithm.use_kl_in_reward
    )


def recompute_log_probs(run, batch: RolloutTensors) -> tuple[torch.Tensor | None, dict]:
    """The actor's log-probs of the rollout (``recomputed_log_probs``); returns sum_v pi^2 when
    ``actor.calculate_sum_pi_squared`` asks for it, and metrics. With ``router_replay.mode=R2``
    the MoE routers' choices are recorded too (``routing``), for the update to replay; with
    ``R3`` the routers replay the rollout's (``rollout_corr/router_agreement``: the share of real
    tokens the trainer's routers would have routed alike)."""
    plan = run.plan.old_log_prob
    mode = run.cfg.actor_rollout_ref.actor.megatron.router_replay.mode
    routing = actor_routing(run, batch)
    if mode == "R2":
        routing = Routing(run.actor.chunks, "record")
    out = global_pass(
        run.actor.chunks,
        batch,
        "actor",
        micro_batches=plan.micro_batch_size,
        max_token_len=plan.max_token_len_per_gpu,
        vocab_size=run.vocab_size,
        temperature=run.cfg.actor_rollout_ref.rollout.temperature,
        sum_pi_squared=run.cfg.actor_rollout_ref.actor.calculate_sum_pi_squared,
        routing=routing,
    )
    batch.fields["recomputed_log_probs"] = out["log_probs"]
    metrics = {}
    if mode == "R2":
        batch.fields[ROUTING] = out[ROUTING]
    elif mode == "R3":
        counts = torch.stack([routing.agree, routing.tokens])  # type: ignore[union-attr]
        metrics["rollout_corr/router_agreement"] = agreement_over_world(counts)
    return out.get("sum_pi_squared"), metrics


def actor_routing(run, batch: RolloutTensors) -> Routing | None:
    """With ``router_replay.mode=R3``: a replaying :class:`Routing` over the actor, the rollout's
    choices for its layers put in the batch's ``ROUTING`` field (the update replays them too);
    otherwise None."""
    if run.cfg.actor_rollout_ref.actor.megatron.router_replay.mode != "R3":
        return None
    routing = Routing(run.actor.chunks, "replay")
    if ROUTING not in batch.fields:
        batch.fields[ROUTING] = routing.from_rollout(batch.fields[ROLLOUT_ROUTING])
    return routing


def reference_log_probs(run, batch: RolloutTensors) -> None:
    """The frozen reference's log-probs (``ref_log_probs``), at the rollout temperature (its
    parameters on the device by the ``ref`` phase's residency). With ``router_replay.mode=R3``
    its routers replay the rollout's choices too."""
    plan = run.plan.ref_log_prob
    routing, view = None, batch
    if run.cfg.actor_rollout_ref.actor.megatron.router_replay.mode == "R3":
        routing = Routing(run.ref.chunks, "replay")  # its own pipeline layout's layers
        view = replace(batch, fields={ROUTING: routing.from_rollout(batch.fields[ROLLOUT_ROUTING])})
    batch.fields["ref_log_probs"], _, _ = global_log_probs(
        run.ref.chunks,
        view,
        vocab_size=run.vocab_size,
        temperature=run.cfg.actor_rollout_ref.rollout.temperature,
        micro_batches=plan.micro_batch_size,
        max_token_len=plan.max_token_len_per_gpu,
        routing=routing,
    )


def correct_for_rollout(batch: RolloutTensors, correction, shortcut: bool) -> dict[str, float]:
    """Old log-probs by ``algorithm.rollout_correction``: decoupled (recomputed), bypass (the
    rollout's own), and truncated importance weights pi_old / pi_rollout (``rollout_is``)."""
    from megarl.algo import compute_rollout_is_weights

    if not shortcut:
        batch.fields["old_log_probs"] = (
            batch.rollout_log_probs
            if correction.bypass_mode
            else batch.fields["recomputed_log_probs"]
        )
    if correction.rollout_is is None or correction.bypass_mode:
        return {}
    weights, metrics = compute_rollout_is_weights(
        batch.fields["recomputed_log_probs"],
        batch.rollout_log_probs,
        batch.response_mask,
        rollout_is=correction.rollout_is,
        rollout_is_threshold=correction.rollout_is_threshold,
        rollout_is_batch_normalize=correction.rollout_is_batch_normalize,
    )
    batch.fields["rollout_is_weights"] = weights
    return {f"rollout_corr/{k}": float(v) for k, v in metrics.items()}
