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
- one send/receive between each pair of :func:`point_to_point_pairs`: the pipeline ring with
  virtual pipeline stages (Megatron's interleaved schedule sends single ``isend``/``irecv``,
  megarl turns ``batch_p2p_comm`` off there; a two-stage pipeline sends one direction over the
  world group), every pair of a pipeline group whose stages hold
  different vLLM TP ranks (the reshard executor's single sends,
  ``megarl.rollout.reshard.executor._PipelineRoute``), and the context-parallel ring above two
  ranks (Transformer Engine's ring attention sends single ``isend``/``irecv`` unless
  ``NVTE_BATCH_MHA_P2P_COMM``).

Every rank walks the same kinds in the same order, each kind's groups are disjoint and the pairs
go in one global order, so the operations pair up. (Binding the default group to a device,
``init_process_group(device_id=...)``, would create the collective communicators eagerly, but
then creating a gloo subgroup has the ranks outside it join an NCCL split that its members never
join: Megatron's gloo data-parallel groups would hang.) On CPU the same calls run on gloo, which
is how the suite checks the list against what a step uses (``tests/parallel/test_connect_groups.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

COLLECTIVE_GROUPS: tuple[tuple[str, str, tuple[tuple[str, bool], ...]], ...] = (
    ("world", "", ()),
    ("model", "get_model_parallel_group", ()),
    ("tensor", "get_tensor_model_parallel_group", ()),
    ("pipeline", "get_pipeline_model_parallel_group", ()),
    ("data", "get_data_parallel_group", ()),
    ("data×context", "get_data_parallel_group", (("with_context_parallel", True),)),
    ("context", "get_context_parallel_group", ()),
    ("tensor×context", "get_tensor_and_context_parallel_group", ()),
    ("embedding", "get_embedding_group", ()),
    ("expert", "get_expert_model_parallel_group", ()),
    ("expert tensor", "get_expert_tensor_parallel_group", ()),
    ("expert tensor×expert", "get_expert_tensor_and_model_parallel_group", ()),
    ("expert tensor×expert×pipeline", "get_expert_tensor_model_pipeline_parallel_group", ()),
    ("expert data", "get_expert_data_parallel_group", ()),
    ("optimizer instance", "get_intra_distributed_optimizer_instance_group", ()),
)
"""``(name, parallel_state getter, its keyword arguments)`` of the groups whose collectives a
step can run: the world (megarl's flags and counts), Megatron's model groups, DDP's and the
distributed optimizer's data × context group, the router losses' tensor × context group, the
allgather token dispatcher's expert-tensor × expert group, the expert grid's groups (gradient
norms of expert parameters). The position-embedding group serves learned absolute positions,
which no model here has. A dense model's expert groups are connected too (a few NCCL buffers)."""


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
    from megatron.core import parallel_state

    found: list[tuple[str, object]] = []
    for name, getter, kwargs in COLLECTIVE_GROUPS:
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


def _pair_groups(rollout_tp: int | None) -> list[tuple[str, object, list[int], bool, int | None]]:
    """``(name, group, members, ring, rollout_tp)`` of this rank's groups with single sends."""
    from megatron.core import parallel_state

    out: list[tuple[str, object, list[int], bool, int | None]] = []
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        vpp = (parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1) > 1
        group = parallel_state.get_pipeline_model_parallel_group()
        members = _members(group)
        out.append(("pipeline", group, members, vpp, rollout_tp))
        if vpp and len(members) == 2:
            # Megatron's _p2p_ops sends one direction of a two-stage pipeline over the world
            # group (p2p_communication.py: "Use the global process group for one of the two").
            out.append(("world", dist.group.WORLD, members, True, None))
    if parallel_state.get_context_parallel_world_size() > 2:
        group = parallel_state.get_context_parallel_group()
        out.append(("context", group, _members(group), True, None))
    return out


def _members(group) -> list[int]:
    return [dist.get_global_rank(group, i) for i in range(dist.get_world_size(group))]


def connect_groups(rollout_tp: int | None = None) -> list[Connection]:
    """Create every communicator a step uses (see the module docstring); returns them in the
    order made. ``rollout_tp``: vLLM's TP size when the engine is colocated (the reshard
    executor's pipeline pairs); None connects no such pairs. Collective over the world."""
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
