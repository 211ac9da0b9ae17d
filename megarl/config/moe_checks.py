"""Checks of a Mixture-of-Experts model's training settings: tensor parallelism beside expert
parallelism, and routing replay (``*.megatron.router_replay.mode``, :mod:`megarl.models.routing`).
Each reports a problem through ``error`` (one line naming the key), as validation collects them.
"""

from __future__ import annotations

from collections.abc import Callable

from megarl.config.batch import ARR, MEG
from megarl.config.model_source import ModelShape

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
    elif meg.recompute_granularity == "full" or (
        meg.recompute_granularity == "selective" and "moe" in meg.recompute_modules
    ):
        error(
            f"{key}: recomputing the MoE layers in the backward pass would route afresh "
            f"there; with routing replay use {MEG}.recompute_granularity=selective without "
            "'moe' in recompute_modules, or null"
        )
