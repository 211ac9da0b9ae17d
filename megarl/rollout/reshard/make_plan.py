"""Building a :class:`~megarl.rollout.reshard.plan.ReshardPlan` (:func:`make_reshard_plan`):
Megatron's parameters in module order, each with its owner, TP shards and HF slots, packed into
buckets of whole modules (a layer's experts one module) with each vLLM TP rank's slices. The
plan's layout and rules are documented in :mod:`megarl.rollout.reshard.plan`."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from megarl.config.model_dims import ModelDims
from megarl.models import hf_mapping as hm
from megarl.models import moe_mapping as mm
from megarl.parallel.layout import ParallelLayout
from megarl.rollout.reshard.plan import (
    DEFAULT_BUCKET_BYTES,
    Bucket,
    HFSlot,
    ParamTransfer,
    ReshardPlan,
    check_rollout_tp,
    owner_of,
    require_training_layout,
    slot_pieces,
)


def _module_of(mg_name: str) -> str:
    """The module ``mg_name`` belongs to for bucketing: a layer's experts are one (vLLM's
    ``FusedMoE``)."""
    if mm.is_expert_param(mg_name):
        return mg_name.split(".mlp.experts.", 1)[0] + ".mlp.experts"
    return mg_name.rsplit(".", 1)[0]


def _expert_runs(params: list[ParamTransfer]) -> tuple[tuple[int, int, int], ...]:
    """Runs of consecutive bucket elements written by one expert-parallel rank."""
    runs: list[list[int]] = []
    for p in params:
        if p.ep_rank is None:
            continue
        start = min(s.offset for s in p.slots)
        stop = max(s.offset + s.span for s in p.slots)
        if runs and runs[-1][0] == p.ep_rank and runs[-1][2] == start:
            runs[-1][2] = stop
        else:
            runs.append([p.ep_rank, start, stop])
    return tuple((k, a, b) for k, a, b in runs)


def _modules_in_order(
    dims: ModelDims, layout: ParallelLayout
) -> tuple[list[tuple[tuple[int, int], list[str]]], list[str]]:
    """Whole modules in Megatron's global order, each with its owner ``(pp_rank, vp_stage)``
    and its parameter names; and the names not sent (the tied output layer)."""
    modules: list[tuple[tuple[int, int], list[str]]] = []
    skipped: list[str] = []
    tied_copy = dims.tie_word_embeddings and layout.pp > 1
    for name in hm.megatron_param_names(dims, include_tied_output=tied_copy):
        if name == hm.OUTPUT_LAYER and dims.tie_word_embeddings:
            skipped.append(name)
            continue
        owner = owner_of(name, dims, layout)
        if (
            modules
            and modules[-1][0] == owner
            and _module_of(modules[-1][1][-1]) == _module_of(name)
        ):
            modules[-1][1].append(name)
        else:
            modules.append((owner, [name]))
    return modules, skipped


@dataclass(frozen=True)
class _Parts:
    """A parameter's transfer before it is placed in a bucket."""

    name: str
    kind: hm.PartitionKind
    shape: tuple[int, ...]
    shard_shape: tuple[int, ...]
    gather: bool
    slots: list[HFSlot]
    ep_rank: int | None


def _transfer_parts(name: str, dims: ModelDims, layout: ParallelLayout) -> _Parts:
    """One Megatron parameter's transfer, HF slots at offset 0; a gathered vocab parameter
    reserves room for its padded rows. Experts: split over expert TP, held by one EP rank."""
    kind = hm.tp_partition_kind(name)
    shape = hm.megatron_param_shape(name, dims)
    ep_rank, split = None, layout.tp
    expert = mm.expert_of_param(name)
    if expert is not None:
        ep_rank, split = expert[0] // (dims.num_experts // layout.ep), layout.etp
    gather = split > 1 and kind != "replicated"
    reserved = math.prod(shape) if gather and kind == "vocab" else 0
    slots = [
        HFSlot(hf_name, hm.hf_param_shape(hf_name, dims), 0, reserved)
        for hf_name in hm.megatron_param_sources(name, dims)
    ]
    shard = hm.tp_shard_shape(name, shape, split)
    return _Parts(name, kind, shape, shard, gather, slots, ep_rank)


def make_reshard_plan(
    dims: ModelDims,
    layout: ParallelLayout,
    rollout_tp: int,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: torch.dtype = torch.bfloat16,
    rollout_ep: bool = False,
) -> ReshardPlan:
    """Plan a Megatron → vLLM weight sync.

    Args:
        dims: model dimensions; ``dims.padded_vocab_size`` must be the training one (padded for
            the training TP, as :meth:`ModelDims.from_hf_config` does with ``tp_size``).
        layout: training TP / PP / VPP (and EP / ETP for MoE models).
        rollout_tp: vLLM tensor-parallel size: sets the slices each rank receives from other
            stages (:func:`rollout_slice`) and the sizes reported.
        bucket_bytes: upper bound of one bucket's flat buffer. A single module larger than
            this forms its own bucket (the bound is then that module's size).
        dtype: element type of the parameters (bytes per element).
        rollout_ep: vLLM runs expert parallelism (``enable_expert_parallel``, EP size = its TP
            size): each vLLM rank loads whole experts, only its own
            (:func:`~megarl.rollout.reshard.vllm_layout.rollout_expert_range`). MoE models
            only, with at least ``rollout_tp`` experts.

    Parameters are visited in Megatron's global order (embedding, layers 0..L-1, final norm,
    output layer); consecutive modules of the same stage share a bucket while they fit.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    require_training_layout(dims, layout)
    check_rollout_tp(dims, rollout_tp, rollout_ep)
    itemsize = dtype.itemsize

    modules, skipped = _modules_in_order(dims, layout)
    buckets: list[Bucket] = []
    current: list[ParamTransfer] = []
    current_stage = -1
    current_alone = False
    offset = 0

    def close() -> None:
        nonlocal current, offset
        if current:
            slots = [s for p in current for s in p.slots]
            slices = tuple(
                tuple(
                    piece
                    for s in slots
                    for piece in slot_pieces(s, dims, rollout_tp, v, rollout_ep)
                )
                for v in range(rollout_tp)
            )
            bucket = Bucket(
                len(buckets),
                current_stage,
                tuple(current),
                offset,
                itemsize,
                slices,
                expert_runs=_expert_runs(current) if layout.ep > 1 else (),
            )
            if layout.pp > 1:  # a message that is not one run of the bucket is packed
                pack = [
                    bucket.message_numel(v)
                    for v in range(rollout_tp)
                    if bucket.message_range(v) is None
                ]
                bucket = dataclasses.replace(bucket, pack_numel=max(pack, default=0))
            buckets.append(bucket)
        current, offset = [], 0

    for (pp_rank, vp_stage), names in modules:
        transfers = [_transfer_parts(name, dims, layout) for name in names]
        module_numel = sum(slot.span for t in transfers for slot in t.slots)
        alone = any(t.kind == "vocab" for t in transfers)
        if current and (
            alone
            or current_alone
            or pp_rank != current_stage
            or (offset + module_numel) * itemsize > bucket_bytes
        ):
            close()
        current_stage, current_alone = pp_rank, alone
        for t in transfers:
            placed = []
            for slot in t.slots:
                placed.append(HFSlot(slot.name, slot.shape, offset, slot.reserved))
                offset += slot.span
            current.append(
                ParamTransfer(
                    name=t.name,
                    pp_rank=pp_rank,
                    vp_stage=vp_stage,
                    partition=t.kind,
                    shape=t.shape,
                    shard_shape=t.shard_shape,
                    needs_gather=t.gather,
                    slots=tuple(placed),
                    itemsize=itemsize,
                    ep_rank=t.ep_rank,
                )
            )
    close()
    return ReshardPlan(
        dims=dims,
        layout=layout,
        rollout_tp=rollout_tp,
        bucket_bytes=bucket_bytes,
        dtype=dtype,
        buckets=tuple(buckets),
        skipped=tuple(skipped),
        rollout_ep=rollout_ep,
    )
