"""The NCCL communicators a GPU holds, for the memory plan (:mod:`megarl.planner.memory_plan`):
each group of two or more ranks keeps its buffers for the whole run."""

from __future__ import annotations

import math

from megarl.config.batch_plan import rollout_ranks
from megarl.config.schema import MegarlConfig
from megarl.config.teachers import megatron_teacher_layout
from megarl.parallel.connect import COLLECTIVE_GROUPS, pair_kinds, point_to_point_pairs
from megarl.parallel.layout import ParallelLayout
from megarl.planner.memory import GIB
from megarl.planner.residency import engine_on_training_ranks

NCCL_COMMUNICATOR_BYTES = GIB // 2
"""GPU memory of one NCCL communicator of two or more ranks: its buffers, allocated outside
PyTorch's allocator when the communicator is made (megarl makes every one a step uses at set-up:
``megarl.parallel.connect.connect_groups``) and kept for the run. An estimate, not measured
here (no GPU): NCCL sizes them as channels × peers × ``NCCL_BUFFSIZE`` (4 MiB) per protocol;
NVIDIA/nccl#964 measured 544-688 MB per communicator after one all-reduce on 4 A100s over
NVLink; NVLS (H100 with NVSwitch) adds more (``NCCL_NVLS_ENABLE=0`` trades it for bandwidth).
A pair's communicator (single sends) is counted the same, though it connects one peer only.
``tools/gpu_check.py``'s memory section shows the difference on a GPU."""


def nccl_communicators(cfg: MegarlConfig, world: int) -> dict[str, int]:
    """The NCCL communicators of two or more ranks the first training GPU holds, by name, with
    their sizes (``world``: the training ranks). Rank 0 holds the most: it is in every kind of
    group (the embedding group's first stage) and the pairs are the same count on every rank.

    What ``megarl.parallel.connect.connect_groups`` makes at set-up, counted from its own lists:
    one per group of ``COLLECTIVE_GROUPS`` (by its name) and one per pair of ranks of
    ``pair_kinds`` that holds rank 0 (``"pipeline 0<->4"``); with a Megatron teacher at a layout
    of its own, its groups again (``"teacher tensor"``, the world shared); with vLLM colocated,
    vLLM's TP group (its torch group and its PyNccl communicator). Groups of one rank are left
    out (no peers, no buffers)."""
    colocated = engine_on_training_ranks(cfg)
    roll = cfg.actor_rollout_ref.rollout
    lay = cfg.actor_rollout_ref.actor.megatron.parallel_layout()
    sizes = _connected(lay, world, roll.tensor_model_parallel_size if colocated else None)
    teacher = megatron_teacher_layout(cfg)
    if teacher is not None:  # megarl.parallel.init.second_layout: connect_groups() again
        shared = {group.name for group in COLLECTIVE_GROUPS if not group.getter}  # the world
        own = _connected(teacher, world, None).items()
        sizes.update({f"teacher {name}": size for name, size in own if name not in shared})
    if colocated:
        sizes["vLLM TP"] = sizes["vLLM TP (PyNccl)"] = roll.tensor_model_parallel_size
    return {name: size for name, size in sizes.items() if size > 1}


def _connected(lay: ParallelLayout, world: int, rollout_tp: int | None) -> dict[str, int]:
    """Rank 0's communicators ``connect_groups(rollout_tp)`` makes at ``lay``, groups of one
    rank included."""
    axes = {"tp": lay.tp, "cp": lay.cp, "dp": lay.data_parallel_size(world), "pp": lay.pp,
            "ep": lay.ep, "etp": lay.etp, "edp": lay.expert_data_parallel_size(world),
            "pp ends": min(lay.pp, 2)}  # fmt: skip
    sizes = {group.name: math.prod(axes[a] for a in group.spans) for group in COLLECTIVE_GROUPS}
    # Rank 0's group of each kind whose ranks pair up, in Megatron's rank order (TP fastest,
    # then CP, DP, PP): a pipeline group steps by one stage's ranks, a context group by TP.
    members = {
        "pipeline": range(0, world, world // lay.pp),
        "context": range(0, lay.tp * lay.cp, lay.tp),
    }
    for kind in pair_kinds(lay.pp, lay.vpp, lay.cp):
        tp = rollout_tp if kind.reshard else None
        for low, high in point_to_point_pairs(
            list(members[kind.members]), ring=kind.ring, rollout_tp=tp
        ):
            if low == 0:
                sizes[f"{kind.over} {low}<->{high}"] = 2
    return sizes


def rollout_rank_communicators(cfg: MegarlConfig, nccl_weights: bool) -> dict[str, int]:
    """A rollout rank's NCCL communicators (vLLM on GPUs of its own): vLLM's TP group (two, as
    colocated) and the weights' group from the first training rank when it is NCCL."""
    tp = cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
    sizes = {"vLLM TP": tp, "vLLM TP (PyNccl)": tp}
    if nccl_weights:
        sizes["weights"] = rollout_ranks(cfg) + 1
    return {name: size for name, size in sizes.items() if size > 1}
