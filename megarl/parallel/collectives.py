"""The one all-gather helper the DP/TP gathers share (log-prob shares over DP, vocabulary shards
and parameter shards over TP), and the gloo group object collectives use (:func:`object_group`)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_tensors(local: torch.Tensor, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """Every rank's ``local`` (the same shape and dtype on every rank of ``group``), in rank order.

    Collective over ``group``.
    """
    local = local.contiguous()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    return parts


_GLOO_WORLD: dict[int, dist.ProcessGroup] = {}
"""The gloo group over the world, per default group (keyed by its id)."""


def object_group(group: dist.ProcessGroup | None = None) -> dist.ProcessGroup | None:
    """The group object collectives use: ``group`` when given; else the default group when it is
    gloo; else a gloo group over the whole world, created once (a collective call on first use:
    every rank reaches it at the same call, so ``new_group`` order agrees).

    Never NCCL: there ``all_gather_object`` would copy every pickled batch to the GPU and back,
    block the device stream and take GPU memory that colocated vLLM and training may not have.
    """
    if group is not None or dist.get_backend() == "gloo":
        return group
    default = dist.distributed_c10d._get_default_group()
    key = id(default)
    if key not in _GLOO_WORLD:
        _GLOO_WORLD.clear()  # a new default group: the old gloo group went with the old one
        _GLOO_WORLD[key] = dist.new_group(backend="gloo")
    return _GLOO_WORLD[key]


def max_over_ranks(values: list[float], group: dist.ProcessGroup | None = None) -> list[float]:
    """The element-wise maximum of ``values`` over the ranks of ``group`` (the same length on
    every rank). The tensor lives on this rank's device: on a GPU the default group is NCCL,
    which takes no CPU tensor. Collective over ``group``."""
    from megarl.parallel.init import device

    t = torch.tensor(values, dtype=torch.float64, device=device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()
