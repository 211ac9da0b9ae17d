"""Checks of disaggregated placement and overlap: vLLM on ranks of its own
(``actor_rollout_ref.rollout.nnodes`` > 0) and ``async_training.*``. Each reports a problem
through ``error`` (one line naming the key), as validation collects them.
"""

from __future__ import annotations

from collections.abc import Callable

from megarl.config.batch_plan import ROLL, rollout_ranks

Error = Callable[[str], None]


def check_async(cfg, error: Error) -> None:
    """The rollout-only ranks hold vLLM replicas (their number a multiple of the rollout TP);
    what the engines on other ranks do not offer yet is refused."""
    roll, a = cfg.actor_rollout_ref.rollout, cfg.async_training
    if roll.nnodes < 0:
        error(f"{ROLL}.nnodes must be >= 0, got {roll.nnodes}")
        return
    if roll.n_gpus_per_node is not None and roll.n_gpus_per_node < 1:
        error(f"{ROLL}.n_gpus_per_node must be a positive number, got {roll.n_gpus_per_node}")
        return
    ranks = rollout_ranks(cfg)
    if a.trigger_parameter_sync_step < 1:
        error(
            "async_training.trigger_parameter_sync_step must be >= 1 (updates between weight "
            f"syncs), got {a.trigger_parameter_sync_step}"
        )
    if not ranks and (a.trigger_parameter_sync_step > 1 or a.partial_rollout):
        key = (
            f"async_training.trigger_parameter_sync_step={a.trigger_parameter_sync_step}"
            if a.trigger_parameter_sync_step > 1
            else "async_training.partial_rollout=true"
        )
        error(f"{key}: fully async training needs vLLM on ranks of its own ({ROLL}.nnodes > 0)")
    if ranks and a.partial_rollout:
        check_partial_rollout(cfg, error)
    if a.staleness_threshold < 0:
        error(f"async_training.staleness_threshold must be >= 0, got {a.staleness_threshold}")
    if not ranks:
        if a.staleness_threshold > 0:
            error(
                f"async_training.staleness_threshold={a.staleness_threshold}: overlap needs "
                f"vLLM on ranks of its own ({ROLL}.nnodes > 0)"
            )
        return
    key = f"{ROLL}.nnodes={roll.nnodes}"
    if roll.name != "vllm":
        error(f"{key}: ranks of their own host a vLLM engine; {ROLL}.name={roll.name}")
    tp = roll.tensor_model_parallel_size
    if tp > 0 and ranks % tp:
        error(
            f"{key}: the {ranks} rollout rank(s) hold vLLM replicas of "
            f"{ROLL}.tensor_model_parallel_size={tp} ranks each; {ranks} is not divisible by {tp}"
        )
    if roll.expert_parallel_size > 1:
        error(f"{key}: vLLM expert parallelism on ranks of its own is not built yet")


def check_partial_rollout(cfg, error: Error) -> None:
    """What partial rollouts (a request interrupted at a weight sync and continued on the new
    weights) are not built for yet, each refused with the reason."""
    arr, key = cfg.actor_rollout_ref, "async_training.partial_rollout=true"
    if arr.rollout.multi_turn.enable:
        error(
            f"{key}: multi-turn trajectories are not interrupted mid-turn yet; set "
            f"{ROLL}.multi_turn.enable=false or partial_rollout=false"
        )
    if arr.actor.megatron.router_replay.mode == "R3":
        error(
            f"{key}: R3 routing replay of a continued response (its segments' routing joined) is "
            "not built yet; use router_replay.mode=R2 or partial_rollout=false"
        )
    if arr.model.lora.rank > 0 and not arr.model.lora.merge:
        error(
            f"{key}: adapter-only syncs (lora.merge=false) do not interrupt requests yet; use "
            "actor_rollout_ref.model.lora.merge=true or partial_rollout=false"
        )
    if cfg.algorithm.adv_estimator == "remax":
        error(
            f"{key}: ReMax's greedy baseline must come from the weights of its sampled batch; "
            "use partial_rollout=false"
        )
