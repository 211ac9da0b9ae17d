"""The step's passes over the whole batch: generation, and the forward-only model passes.

Generation: every rank holds the step's global prompt list; the engine's replicas split it and
every rank gets every response back (:func:`megarl.rollout.distribute.generate_distributed`).
Forward passes: each DP rank computes its contiguous share and the shares are all-gathered over
the DP group, so each returns the global ``[B, R]`` tensor on every rank. Each pass returns its
tensors; :func:`megarl.trainer.step.train_step` puts them in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from megatron.core import parallel_state

from megarl.data import PromptSample
from megarl.models.routing import (
    ROUTING,
    Routing,
    agreement_over_world,
    pad_positions,
    rollout_routing,
)
from megarl.models.runner import compute_log_probs, compute_values
from megarl.models.vl_inputs import ImageRows
from megarl.parallel.collectives import all_gather_tensors
from megarl.parallel.init import device
from megarl.rollout.base import AheadEngine, RolloutBatch, RolloutEngine
from megarl.rollout.distribute import generate_distributed
from megarl.rollout.multi_turn import rollout_samples
from megarl.rollout.multi_turn_rollout import MultiTurnRollout
from megarl.trainer import split
from megarl.trainer.batch import StepBatch, batch_from_samples
from megarl.trainer.split import dp_share, fitting_micro_batch


def generate(
    engine: RolloutEngine,
    prompts: Sequence[PromptSample],
    *,
    n: int,
    sampling: dict[str, Any],
    seed: int,
    step: int,
    pad_token_id: int,
    multi_turn: MultiTurnRollout | None = None,
    image_width: int | None = None,
) -> tuple[StepBatch, RolloutBatch]:
    """``n`` responses to each prompt, prompt-major, as the step's batch on every rank (with the
    rollout's routing when the engine captured it, for R3).

    ``image_width`` (a vision-language actor's patch width, :func:`image_patch_width`): the
    prompts' ``images`` go to the engine and each response carries its prompt's
    ``multi_modal_inputs`` as the batch's ``images`` (every pass of the actor reads them).

    Multi-turn (``multi_turn``, else the engine's ``multi_turn`` attribute when set: a
    :class:`~megarl.rollout.multi_turn_rollout.MultiTurnRollout`): each response is a trajectory of model
    and tool/user turns, and ``response_mask`` is 1 on the model's tokens only; the rollout
    batch's ``metrics`` carry the turn and tool-call counts."""
    multi_turn = multi_turn or getattr(engine, "multi_turn", None)
    if multi_turn is not None:
        trajs = multi_turn.generate(engine, prompts, n=n, sampling=sampling, seed=seed, step=step)
        out = rollout_samples(trajs, n)
        out.metrics = dict(multi_turn.last_metrics)
    else:
        out = generate_distributed(
            engine,
            [list(p.prompt_ids) for p in prompts],
            dp_rank=0,
            dp_size=1,
            n=n,
            seed=seed,
            step=step,
            **({} if image_width is None else {"images": [p.images for p in prompts]}),
            **sampling,
        )
    batch = batch_from_samples(out, pad_token_id=pad_token_id)
    batch.rollout_routing = captured_routing(out, batch.input_ids.shape[1])
    if image_width is not None:
        batch.images = prompt_images(prompts, out.samples, image_width)
    return batch, out


def prompt_images(prompts: Sequence[PromptSample], samples: Sequence, width: int) -> ImageRows:
    """Each sample's prompt's ``multi_modal_inputs`` (pixels and grids; none for a text prompt)
    as the batch's :class:`ImageRows`, ``width`` the patch width (a batch without images)."""
    return ImageRows.from_rows([prompts[s.prompt_index].multi_modal_inputs for s in samples], width)


def image_patch_width(model_path: str) -> int:
    """The vision tower's patch width (channels · temporal patch · patch², the processor's
    ``pixel_values`` columns) of the VL checkpoint at ``model_path``."""
    import json
    from pathlib import Path

    vision = json.loads((Path(model_path) / "config.json").read_text())["vision_config"]
    channels = vision.get("in_channels", vision.get("in_chans", 3))
    return channels * vision.get("temporal_patch_size", 2) * vision.get("patch_size", 14) ** 2


def captured_routing(out: RolloutBatch, width: int) -> torch.Tensor | None:
    """The routing the engine captured for R3, ``[B, width, layers, k]``: every response's, or
    none (the engine captures none); a response without raises rather than be replayed
    onto experts 0..k-1."""
    captured = [s.routing is not None for s in out]
    if not any(captured):
        return None
    if not all(captured):
        missing = captured.index(False)
        raise RuntimeError(
            f"router_replay.mode=R3: the rollout engine returned no routing for response "
            f"{missing} (prompt {out.samples[missing].prompt_id}) of {len(out)}"
        )
    return rollout_routing([s.routing for s in out], width)


def prefetch(
    engine: AheadEngine,
    prompts: Sequence[PromptSample],
    requests: Sequence[tuple[int, dict[str, Any], dict | None]],
    *,
    seed: int,
    step: int,
) -> None:
    """Ask an engine on other ranks for the batches later :func:`generate` calls with these
    arguments take, one per request ``(n, sampling, reward)``: the requests that
    :func:`~megarl.rollout.distribute.generate_distributed` makes of the engine's one replica
    (a later request that differs is asked for anew); multi-turn: the loop's requests."""
    multi_turn = getattr(engine, "multi_turn", None)
    if multi_turn is not None:
        multi_turn.prefetch(engine, prompts, requests, seed=seed, step=step)
        return
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
    batch: StepBatch,
    *,
    vocab_size: int,
    temperature: float,
    micro_batches: int | None,
    max_token_len: int | None = None,
    sum_pi_squared: bool = False,
    routing: Routing | None = None,
    replay: torch.Tensor | None = None,
    pack: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Log-probs, entropy and (when asked) sum_v pi^2, ``[B, R]`` for every response token of
    the batch, on every rank. ``routing``: a replaying :class:`Routing`, fed ``replay``."""
    out = global_pass(
        chunks,
        batch,
        "actor",
        micro_batches=micro_batches,
        max_token_len=max_token_len,
        replay=replay,
        pack=pack,
        vocab_size=vocab_size,
        temperature=temperature,
        sum_pi_squared=sum_pi_squared,
        routing=routing,
    )
    return out["log_probs"], out["entropy"], out.get("sum_pi_squared")


def global_pass(
    chunks: Sequence[torch.nn.Module],
    batch: StepBatch,
    role: str,
    *,
    micro_batches: int | None,
    max_token_len: int | None = None,
    replay: torch.Tensor | None = None,
    pack: bool = False,
    **kwargs: Any,
) -> dict[str, torch.Tensor]:
    """A forward-only pass over the whole batch: each DP rank computes its contiguous share and
    the shares are all-gathered, so every rank gets every output ``[B, R]`` (and, recording, the
    ``ROUTING``). A replaying ``routing`` (in ``kwargs``) is fed ``replay``; ``pack``: packed
    rows (:mod:`megarl.models.packing`). Context-parallel peers compute the same share."""
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    everyone = torch.arange(len(batch))
    rows = dp_share(everyone, dp_rank, dp_size)
    replaying = kwargs.get("routing") is not None and kwargs["routing"].mode == "replay"
    sequences = batch.sequences(rows, replay=replay if replaying else None)
    if max_token_len is None:  # the configured size, lowered to a divisor of the rows
        micro: Any = fitting_micro_batch(len(rows), micro_batches or len(rows))
    else:
        micro = split.micro_batches(batch.lengths, everyone, dp_rank, dp_size,
                                    micro_batch_size=None, max_token_len=max_token_len,
                                    cp=parallel_state.get_context_parallel_world_size())  # fmt: skip
    routing = None
    if role == "critic":
        outputs = {"values": compute_values(chunks, sequences, micro_batches=micro, pack=pack)}
    else:
        out = compute_log_probs(chunks, sequences, micro_batches=micro, pack=pack, **kwargs)
        outputs = {"log_probs": out.log_probs, "entropy": out.entropy}
        if out.sum_pi_squared is not None:
            outputs["sum_pi_squared"] = out.sum_pi_squared
        if out.topk_log_probs is not None:  # ``[n, r, k]``: a teacher's (kwargs ``topk``)
            outputs["topk_log_probs"] = out.topk_log_probs
            outputs["topk_ids"] = out.topk_ids
        routing = out.routing
    width = batch.response_mask.shape[1]
    gathered = {k: gather_dp(pad_to_width(v, width), dp_size) for k, v in outputs.items()}
    if routing is not None:  # every position of every sequence, this pipeline rank's layers
        local = pad_positions(routing, batch.input_ids.shape[1]).int()  # NCCL, gloo: no int16
        gathered[ROUTING] = gather_dp(local, dp_size).to(routing.dtype)
    return gathered


def pad_to_width(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` ``[n, r, ...]`` cut or zero-padded along dim 1 to ``width``."""
    if t.shape[1] >= width:
        return t[:, :width]
    return torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, width - t.shape[1]))


def gather_dp(local: torch.Tensor, dp_size: int) -> torch.Tensor:
    """Every DP rank's equal-sized ``local`` rows, concatenated in DP-rank order (on the CPU)."""
    if dp_size == 1:
        return local.cpu()
    group = parallel_state.get_data_parallel_group()
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


@dataclass
class ActorPass:
    """What the old-log-prob pass returns."""

    log_probs: torch.Tensor
    """``[B, R]`` the actor's log-probs of the rollout (``StepBatch.recomputed_log_probs``)."""
    sum_pi_squared: torch.Tensor | None = None
    """``[B, R]`` sum_v pi^2 (``actor.calculate_sum_pi_squared``)."""
    routing: torch.Tensor | None = None
    """The routing the update replays (``StepBatch.routing``): R2's record, R3's rollout's."""
    metrics: dict[str, float] = field(default_factory=dict)


def recompute_log_probs(run, batch: StepBatch) -> ActorPass:
    """The actor's log-probs of the rollout; sum_v pi^2 when ``actor.calculate_sum_pi_squared``
    asks for it. With ``router_replay.mode=R2`` the MoE routers' choices are recorded, for the
    update to replay; with ``R3`` the routers replay the rollout's (``rollout_corr/
    router_agreement``: the share of real tokens the trainer's routers would have routed alike)."""
    plan = run.plan.old_log_prob
    mode = run.cfg.actor_rollout_ref.actor.megatron.router_replay.mode
    replay = actor_replay_routing(run, batch)
    kind = {"R2": "record", "R3": "replay"}.get(mode)
    routing = Routing(run.actor.chunks, kind) if kind else None
    out = global_pass(
        run.actor.chunks,
        batch,
        "actor",
        micro_batches=plan.micro_batch_size,
        max_token_len=plan.max_token_len_per_gpu,
        replay=replay,
        pack=run.actor.pack,
        vocab_size=run.vocab_size,
        temperature=run.cfg.actor_rollout_ref.rollout.temperature,
        sum_pi_squared=run.cfg.actor_rollout_ref.actor.calculate_sum_pi_squared,
        routing=routing,
    )
    result = ActorPass(out["log_probs"], out.get("sum_pi_squared"), replay)
    if mode == "R2":
        result.routing = out[ROUTING]
    elif mode == "R3":
        counts = torch.stack([routing.agree, routing.tokens])  # type: ignore[union-attr]
        result.metrics["rollout_corr/router_agreement"] = agreement_over_world(counts)
    return result


def actor_replay_routing(run, batch: StepBatch) -> torch.Tensor | None:
    """With ``router_replay.mode=R3``: the rollout's choices for the actor's layers on this
    pipeline rank (the old-log-prob pass and the update replay them); otherwise None."""
    if run.cfg.actor_rollout_ref.actor.megatron.router_replay.mode != "R3":
        return None
    if batch.rollout_routing is None:
        raise RuntimeError(
            "router_replay.mode=R3: the rollout engine returned no routing for this batch"
        )
    return Routing(run.actor.chunks, "replay").from_rollout(batch.rollout_routing)


def reference_log_probs(run, batch: StepBatch) -> torch.Tensor:
    """The frozen reference's log-probs ``[B, R]``, at the rollout temperature (its parameters on
    the device by the ``ref`` phase's residency). Its routers route afresh under routing replay
    too, as verl's and slime's (the KL is to the reference policy as it would act)."""
    return frozen_log_probs(run, run.ref, batch)


def frozen_log_probs(run, model, batch: StepBatch) -> torch.Tensor:
    """A frozen model's log-probs ``[B, R]`` at the rollout temperature, batched as the
    reference's pass (``actor_rollout_ref.ref.log_prob_*``)."""
    plan = run.plan.ref_log_prob
    log_probs, _, _ = global_log_probs(
        model.chunks,
        batch,
        vocab_size=run.vocab_size,
        temperature=run.cfg.actor_rollout_ref.rollout.temperature,
        micro_batches=plan.micro_batch_size,
        max_token_len=plan.max_token_len_per_gpu,
        pack=model.pack,
    )
    return log_probs


def critic_values(
    critic, batch: StepBatch, *, micro_batches: int | None, max_token_len: int | None
) -> torch.Tensor:
    """The critic's values ``[B, R]`` of every response token of the batch, on every rank."""
    return global_pass(critic.chunks, batch, "critic", micro_batches=micro_batches,
                       max_token_len=max_token_len, pack=critic.pack)["values"]  # fmt: skip


@dataclass
class Correction:
    """π_old by ``algorithm.rollout_correction``, and its importance weights."""

    old_log_probs: torch.Tensor | None
    """``[B, R]``: recomputed (decoupled), the rollout's (bypass); None under the shortcut."""
    rollout_is_weights: torch.Tensor | None = None
    """``[B, R]`` truncated π_old / π_rollout (``rollout_is``)."""
    metrics: dict[str, float] = field(default_factory=dict)


def correct_for_rollout(batch: StepBatch, correction, shortcut: bool) -> Correction:
    """Old log-probs by ``algorithm.rollout_correction``: decoupled (recomputed), bypass (the
    rollout's own), and truncated importance weights pi_old / pi_rollout (``rollout_is``)."""
    from megarl.algo import compute_rollout_is_weights

    old = None
    if not shortcut:
        old = batch.rollout_log_probs if correction.bypass_mode else batch.recomputed_log_probs
    if correction.rollout_is is None or correction.bypass_mode:
        return Correction(old)
    weights, metrics = compute_rollout_is_weights(
        batch.recomputed_log_probs,
        batch.rollout_log_probs,
        batch.response_mask,
        rollout_is=correction.rollout_is,
        rollout_is_threshold=correction.rollout_is_threshold,
        rollout_is_batch_normalize=correction.rollout_is_batch_normalize,
    )
    return Correction(old, weights, {f"rollout_corr/{k}": float(v) for k, v in metrics.items()})
