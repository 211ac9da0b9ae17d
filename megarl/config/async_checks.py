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
    if a.trigger_parameter_sync_step != 1:
        error(
            f"async_training.trigger_parameter_sync_step={a.trigger_parameter_sync_step}: "
            "megarl syncs the weights after every update (several updates between syncs are not "
            "built yet); use 1"
        )
    if a.partial_rollout:
        error(
            "async_training.partial_rollout=true: megarl finishes every rollout it started "
            "(no partial rollouts yet); use false"
        )
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
