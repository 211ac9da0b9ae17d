"""The one all-gather helper the DP/TP gathers share (log-prob shares over DP, vocabulary shards
and parameter shards over TP)."""

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
