"""How a LoRA adapter's factors are split over TP (:mod:`megarl.models.lora`): this rank's
shards from the full tensors and back, and the adapted linear's sharded state dict (the
factors sharded as the base weight, so a checkpoint loads at any layout)."""

from __future__ import annotations

import torch

from megarl.models import hf_mapping as hm


def _tp_group(linear: torch.nn.Module):
    """The linear's TP group: ``tp_group`` on Megatron's linears, ``_tp_group`` on its TE ones."""
    group = getattr(linear, "tp_group", None)
    return group if group is not None else linear._tp_group


def sharded_state_dict_with_adapter(
    linear,
    prefix: str = "",
    sharded_offsets: tuple = (),
    metadata: dict | None = None,
    *,
    fc1: bool = False,
) -> dict:
    """The linear's own sharded state dict with its adapter's tensors sharded as the base weight
    (Megatron's would save them as replicated): column B by rows (``linear_fc1``'s through the
    gate/up factory, as its weight), row A by columns; so a checkpoint loads at any layout."""
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
    from megatron.core.transformer.utils import (
        ensure_metadata_has_dp_cp_group,
        make_sharded_tensors_for_checkpoint,
    )

    metadata = ensure_metadata_has_dp_cp_group(metadata)
    out = type(linear).sharded_state_dict(linear, prefix, sharded_offsets, metadata)
    lora = linear.lora
    axis = {"lora.B": 0} if lora.parallel == "column" else {"lora.A": 1}
    out.update(make_sharded_tensors_for_checkpoint(
        {"lora.A": lora.A, "lora.B": lora.B}, prefix, axis, sharded_offsets,
        tp_group=_tp_group(linear), dp_cp_group=metadata["dp_cp_group"],
    ))  # fmt: skip
    if fc1:
        key = f"{prefix}lora.B"
        singleton = metadata.get("singleton_local_shards", False)
        out[key] = apply_swiglu_sharded_factory(out[key], sharded_offsets, singleton)
    return out


def shard_adapter(
    kind: str, base_name: str, a: torch.Tensor, b: torch.Tensor, tp_size: int, tp_rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This TP rank's (A, B) from the full ones: the base weight's split (``hm.tp_split`` of
    the base name) on B's rows (column) or A's columns (row); the other one replicated."""
    if tp_size == 1:
        return a, b
    if kind == "column":
        return a, _split_rows_like(base_name, b, tp_size, tp_rank)
    return torch.chunk(a, tp_size, dim=1)[tp_rank], b


def _split_rows_like(base_name: str, b: torch.Tensor, tp_size: int, tp_rank: int) -> torch.Tensor:
    if hm.tp_partition_kind(base_name) == "fc1":
        gate, up = torch.chunk(b, 2, dim=0)
        return torch.cat([torch.chunk(gate, tp_size)[tp_rank], torch.chunk(up, tp_size)[tp_rank]])
    return torch.chunk(b, tp_size, dim=0)[tp_rank]


def merge_adapter_shards(kind: str, base_name: str, a_shards, b_shards) -> tuple:
    """Inverse of :func:`shard_adapter`: the full (A, B) from every TP rank's shards."""
    if len(a_shards) == 1:
        return a_shards[0], b_shards[0]
    if kind == "row":
        return torch.cat(list(a_shards), dim=1), b_shards[0]
    if hm.tp_partition_kind(base_name) == "fc1":
        gates, ups = zip(*(torch.chunk(s, 2, dim=0) for s in b_shards), strict=True)
        return a_shards[0], torch.cat([*gates, *ups])
    return a_shards[0], torch.cat(list(b_shards))
