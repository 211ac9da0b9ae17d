"""Every NCCL communicator a step uses, created at set-up while the GPU is still empty.

NCCL creates a communicator at its first operation and allocates its buffers outside PyTorch's
caching allocator; one first used after a phase that left the cache holding the GPU fails there
("Failed to CUDA calloc async 4 bytes": an H100, 2026-11-27, the first gradient-norm all-reduce
after generation). PyTorch's NCCL process group keeps one communicator per group for its
collectives (batched point-to-point, ``batch_isend_irecv``, included) and one more per pair of
ranks for each *single* send or receive (``ProcessGroupNCCL::pointToPoint`` keys them
``"low:high"``). :func:`connect_groups` makes all of them at set-up:

- one all-reduce of one element on each of :data:`COLLECTIVE_GROUPS` (a group this rank is not
  in skipped; one group object reached by two names connected once);
- one send/receive between each pair of :func:`point_to_point_pairs` of each of
  :func:`pair_kinds`: the pipeline ring with virtual pipeline stages (Megatron's interleaved
  schedule sends single ``isend``/``irecv``, megarl turns ``batch_p2p_comm`` off there; a
  two-stage pipeline sends one direction over the world group), every pair of a pipeline group
  whose stages hold different vLLM TP ranks (the reshard executor's single sends,
  ``megarl.rollout.reshard.executor._PipelineRoute``), and the context-parallel ring above two
  ranks (Transformer Engine's ring attention sends single ``isend``/``irecv`` unless
  ``NVTE_BATCH_MHA_P2P_COMM``).

The memory planner counts from the same lists
(:func:`megarl.planner.communicators.nccl_communicators`), so a group added here is planned too;
``tests/planner/test_communicators.py`` runs :func:`connect_groups` on torch's fake backend at
several layouts against its count.

Every rank walks the same kinds in the same order, each kind's groups are disjoint and the pairs
go in one global order, so the operations pair up. (Binding the default group to a device,
``init_process_group(device_id=...)``, would create the collective communicators eagerly, but
then creating a gloo subgroup has the ranks outside it join an NCCL split that its members never
join: Megatron's gloo data-parallel groups would hang.) On CPU the same calls run on gloo, which
is how the suite checks the list against what a step uses (``tests/parallel/test_connect_groups.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

# torch is imported inside the functions that run collectives: the memory planner reads the
# lists below to count the communicators (megarl/planner/communicators.py) without torch.


class CollectiveGroup(NamedTuple):
    """One group :func:`connect_groups` runs a collective on."""

    name: str
    getter: str
    """Its ``parallel_state`` getter ("": the world, ``dist.group.WORLD``)."""
    kwargs: tuple[tuple[str, bool], ...]
    """The getter's keyword arguments."""
    spans: tuple[str, ...]
    """The layout's sizes whose product is its size on rank 0: ``tp``, ``cp``, ``dp``, ``pp``,
    ``ep``, ``etp``, ``edp`` (expert data), ``pp ends`` (the first and last stage: 2 at PP > 1)."""


COLLECTIVE_GROUPS: tuple[CollectiveGroup, ...] = (
    CollectiveGroup("world", "", (), ("tp", "cp", "dp", "pp")),
    CollectiveGroup("model", "get_model_parallel_group", (), ("tp", "pp")),
    CollectiveGroup("tensor", "get_tensor_model_parallel_group", (), ("tp",)),
    CollectiveGroup("pipeline", "get_pipeline_model_parallel_group", (), ("pp",)),
    CollectiveGroup("data", "get_data_parallel_group", (), ("dp",)),
    CollectiveGroup(
        "data×context", "get_data_parallel_group", (("with_context_parallel", True),), ("dp", "cp")
    ),
    CollectiveGroup("context", "get_context_parallel_group", (), ("cp",)),
    CollectiveGroup("tensor×context", "get_tensor_and_context_parallel_group", (), ("tp", "cp")),
    CollectiveGroup("embedding", "get_embedding_group", (), ("pp ends",)),
    CollectiveGroup("expert", "get_expert_model_parallel_group", (), ("ep",)),
    CollectiveGroup("expert tensor", "get_expert_tensor_parallel_group", (), ("etp",)),
    CollectiveGroup(
        "expert tensor×expert", "get_expert_tensor_and_model_parallel_group", (), ("etp", "ep")
    ),
    CollectiveGroup(
        "expert tensor×expert×pipeline",
        "get_expert_tensor_model_pipeline_parallel_group",
        (),
        ("etp", "ep", "pp"),
    ),
    CollectiveGroup("expert data", "get_expert_data_parallel_group", (), ("edp",)),
    CollectiveGroup(  # one distributed-optimizer instance (megarl's): the whole world
        "optimizer instance",
        "get_intra_distributed_optimizer_instance_group",
        (),
        ("etp", "ep", "edp", "pp"),
    ),
)
"""The groups whose collectives a step can run: the world (megarl's flags and counts), Megatron's
model groups, DDP's and the distributed optimizer's data × context group, the router losses'
tensor × context group, the allgather token dispatcher's expert-tensor × expert group, the expert
grid's groups (gradient norms of expert parameters). The position-embedding group serves learned
absolute positions, which no model here has. Megatron makes each group an object of its own, so
two of the same ranks (TP and TP × CP at CP 1) are two communicators. A dense model's expert
groups are connected too."""


class PairKind(NamedTuple):
    """Pairs of ranks that exchange single sends: the ranks of the group ``members`` (a name in
    :data:`COLLECTIVE_GROUPS`) pair up, and the messages go over the group ``over``."""

    over: str
    members: str
    ring: bool
    """Neighbours on the ring of ``members``."""
    reshard: bool
    """Every pair whose ranks hold different vLLM TP ranks, with a colocated vLLM (the reshard
    executor's rule, :func:`point_to_point_pairs`)."""


def pair_kinds(pp: int, vpp: int, cp: int) -> list[PairKind]:
    """The single sends of a layout of ``pp`` stages of ``vpp`` chunks each and CP ``cp``: the
    pipeline's (the reshard executor's; the interleaved schedule's ring, and at two stages its
    second direction over the world group) and the context-parallel ring above two ranks."""
    kinds = []
    if pp > 1:
        kinds.append(PairKind("pipeline", "pipeline", ring=vpp > 1, reshard=True))
        if vpp > 1 and pp == 2:
            # Megatron's _p2p_ops sends one direction of a two-stage pipeline over the world
            # group (p2p_communication.py: "Use the global process group for one of the two").
            kinds.append(PairKind("world", "pipeline", ring=True, reshard=False))
    if cp > 2:
        kinds.append(PairKind("context", "context", ring=True, reshard=False))
    return kinds


@dataclass(frozen=True)
class Connection:
    """One communicator :func:`connect_groups` created: a group's collective one
    (``pair`` None) or the one of a pair of its ranks (global ranks, low first)."""

    name: str
    group: object
    pair: tuple[int, int] | None = None


def point_to_point_pairs(
    members: list[int], *, ring: bool, rollout_tp: int | None = None
) -> list[tuple[int, int]]:
    """The pairs of global ranks of one group (``members``, in group order) that send single
    messages to each other: neighbours on the ring when ``ring``; every pair when
    ``rollout_tp`` is given and the members hold different vLLM TP ranks (``rank %
    rollout_tp``, the reshard executor's rule). Sorted, low rank first; none for one member."""
    if len(members) < 2:
        return []
    pairs: set[tuple[int, int]] = set()
    if ring:
        for i, rank in enumerate(members):
            peer = members[(i + 1) % len(members)]
            pairs.add((min(rank, peer), max(rank, peer)))
    if rollout_tp is not None and len({m % rollout_tp for m in members}) > 1:
        pairs.update(
            (a, b) for i, a in enumerate(sorted(members)) for b in sorted(members)[i + 1 :]
        )
    return sorted(pairs)


def _collective_groups() -> list[tuple[str, object]]:
    import torch.distributed as dist
    from megatron.core import parallel_state

    found: list[tuple[str, object]] = []
    for name, getter, kwargs, _ in COLLECTIVE_GROUPS:
        if not getter:
            found.append((name, dist.group.WORLD))
            continue
        try:
            groups = getattr(parallel_state, getter)(**dict(kwargs))
        except AssertionError:  # not made, or this rank is in none of them (embedding)
            continue
        for group in groups if isinstance(groups, list) else [groups]:
            if group is not None and all(group is not g for _, g in found):
                found.append((name, group))
    return found


def _group_named(name: str):
    """This rank's group of :data:`COLLECTIVE_GROUPS` called ``name``."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    _, getter, kwargs, _ = next(g for g in COLLECTIVE_GROUPS if g.name == name)
    return getattr(parallel_state, getter)(**dict(kwargs)) if getter else dist.group.WORLD


def _pair_groups(rollout_tp: int | None) -> list[tuple[str, object, list[int], bool, int | None]]:
    """``(name, group, members, ring, rollout_tp)`` of this rank's groups with single sends."""
    from megatron.core import parallel_state

    kinds = pair_kinds(
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1,
        parallel_state.get_context_parallel_world_size(),
    )
    return [
        (kind.over, _group_named(kind.over), _members(_group_named(kind.members)), kind.ring,
         rollout_tp if kind.reshard else None)
        for kind in kinds
    ]  # fmt: skip


def _members(group) -> list[int]:
    import torch.distributed as dist

    return [dist.get_global_rank(group, i) for i in range(dist.get_world_size(group))]


def connect_groups(rollout_tp: int | None = None) -> list[Connection]:
    """Create every communicator a step uses (see the module docstring); returns them in the
    order made. ``rollout_tp``: vLLM's TP size when the engine is colocated (the reshard
    executor's pipeline pairs); None connects no such pairs. Collective over the world."""
    import torch
    import torch.distributed as dist

    device = "cuda" if torch.cuda.is_available() else "cpu"
    one = torch.zeros(1, device=device)
    done = []
    for name, group in _collective_groups():
        dist.all_reduce(one, group=group)
        done.append(Connection(name, group))
    me = dist.get_rank()
    # Every rank walks every group's pairs in one global order (the groups of a kind are
    # disjoint; each rank takes part in its own pairs only), so no rank waits on a pair whose
    # other rank is still waiting on an earlier one.
    for name, group, members, ring, tp in _pair_groups(rollout_tp):
        for low, high in point_to_point_pairs(members, ring=ring, rollout_tp=tp):
            if me == low:
                dist.send(one, dst=high, group=group)
            elif me == high:
                dist.recv(one, src=low, group=group)
            else:
                continue
            done.append(Connection(name, group, (low, high)))
    return done
