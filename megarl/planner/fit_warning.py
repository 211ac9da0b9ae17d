"""The fit warning of ``megarl config validate`` and ``megarl train``: the memory plan
(:func:`megarl.planner.memory_plan.plan_memory`) of a valid config on this machine's GPUs, in
one line when it does not fit; and the GPU memory the planner assumes where no GPU answers."""

from __future__ import annotations

from megarl.config.batch_plan import world_size
from megarl.config.model_dims import ModelDims
from megarl.config.schema import MegarlConfig
from megarl.planner.memory import GIB
from megarl.planner.memory_plan import Cluster, plan_memory

DEFAULT_GPU_MEMORY_GIB = 79.2
"""GPU memory assumed where no GPU answers: an H100 80GB's total as CUDA reports it (about
79.2 GiB, not 80: part of the 80 GB is the driver's); ``megarl plan --gpu-memory`` overrides."""


def gpu_memory_gib(default: float = DEFAULT_GPU_MEMORY_GIB) -> float:
    """This machine's GPU memory in GiB as CUDA reports it (device 0), or ``default`` where
    CUDA does not run (a CPU machine, a login node)."""
    import torch

    if not torch.cuda.is_available():
        return default
    return torch.cuda.get_device_properties(0).total_memory / GIB


def memory_warnings(cfg: MegarlConfig, world: int | None = None) -> list[str]:
    """One warning when ``cfg`` (already valid: :func:`megarl.config.validate`) does not fit on
    this machine's GPUs (:func:`gpu_memory_gib`: on a login node an H100's) at ``world`` ranks
    (default nnodes x n_gpus_per_node); none on CPU or when the model's shape is unknown (no
    config.json, preset or complete architecture)."""
    from megarl.config.errors import ConfigError
    from megarl.planner.model_presets import resolve_hf_config

    if cfg.trainer.device != "cuda":
        return []
    world = world or world_size(cfg)
    try:
        hf, _ = resolve_hf_config(cfg.actor_rollout_ref.model)
        dims = ModelDims.from_hf_config(hf)
    except (OSError, ValueError):
        return []
    gpus, gib = cfg.trainer.n_gpus_per_node, gpu_memory_gib()
    cluster = Cluster(world // gpus, gpus, gib) if world % gpus == 0 else Cluster(1, world, gib)
    try:
        plan = plan_memory(cfg, dims, cluster)
    except ConfigError:
        return []
    if plan.fits:
        return []
    bad = [f"{p.name} {p.total / GIB:.1f} GiB" for p in plan.phases if not plan.phase_fits(p)]
    if plan.kv_cache["bytes"] <= 0:
        bad.append("rollout: no room left for vLLM's KV cache")
    return [
        (
            f"memory: does not fit on {gib:.3g} GiB GPUs ({cluster.usable_bytes / GIB:.3g} GiB "
            f"usable per GPU): {', '.join(bad)}; `megarl plan --config ...` shows the terms and "
            "layouts that fit"
        )
    ]
