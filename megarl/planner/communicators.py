"""The NCCL communicators a GPU holds, for the memory plan (:mod:`megarl.planner.memory_plan`):
each group of two or more ranks keeps its buffers for the whole run."""

from __future__ import annotations

from megarl.config.batch_plan import rollout_ranks
from megarl.config.schema import MegarlConfig
from megarl.planner.memory import GIB
from megarl.planner.residency import engine_is_vllm, engine_on_training_ranks

NCCL_COMMUNICATOR_BYTES = GIB // 2
"""GPU memory of one NCCL communicator of two or more ranks: its buffers, allocated outside
PyTorch's allocator when the communicator is made (megarl connects every Megatron group at
set-up: ``megarl.parallel.init.connect_groups``) and kept for the run. An estimate, not measured
here (no GPU): NCCL sizes them as channels × peers × ``NCCL_BUFFSIZE`` (4 MiB) per protocol;
NVIDIA/nccl#964 measured 544-688 MB per communicator after one all-reduce on 4 A100s over
NVLink; NVLS (H100 with NVSwitch) adds more (``NCCL_NVLS_ENABLE=0`` trades it for bandwidth).
``tools/gpu_check.py``'s memory section shows the difference on a GPU."""


def nccl_communicators(cfg: MegarlConfig, world: int) -> dict[str, int]:
    """The NCCL communicators of two or more ranks a training GPU holds, by group, with their
    sizes (``world``: the training ranks): the world's, Megatron's groups (each a communicator of its own, connected at set-up:
    ``megarl.parallel.init.GROUPS``; the DP × CP group DDP reduces over when CP > 1) and, with
    vLLM colocated at TP > 1, vLLM's TP group (its torch group and its PyNccl communicator).
    Groups of one rank are left out (no peers, no buffers)."""
    lay = cfg.actor_rollout_ref.actor.megatron.parallel_layout()
    dp = lay.data_parallel_size(world)
    sizes = {
        "world": world,
        "TP×PP": lay.tp * lay.pp,
        "TP": lay.tp,
        "PP": lay.pp,
        "DP": dp,
        "CP": lay.cp,
        "DP×CP": dp * lay.cp if lay.cp > 1 else 1,
        "embedding": 2 if lay.pp > 1 else 1,
        "EP": lay.ep,
        "expert TP": lay.etp,
        "expert DP": lay.expert_data_parallel_size(world),
    }
    roll = cfg.actor_rollout_ref.rollout
    if engine_on_training_ranks(cfg) and engine_is_vllm(cfg):
        sizes["vLLM TP"] = sizes["vLLM TP (PyNccl)"] = roll.tensor_model_parallel_size
    return {name: size for name, size in sizes.items() if size > 1}


def rollout_rank_communicators(cfg: MegarlConfig, nccl_weights: bool) -> dict[str, int]:
    """A rollout rank's NCCL communicators (vLLM on GPUs of its own): vLLM's TP group (two, as
    colocated) and the weights' group from the first training rank when it is NCCL."""
    tp = cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
    sizes = {"vLLM TP": tp, "vLLM TP (PyNccl)": tp}
    if nccl_weights:
        sizes["weights"] = rollout_ranks(cfg) + 1
    return {name: size for name, size in sizes.items() if size > 1}
