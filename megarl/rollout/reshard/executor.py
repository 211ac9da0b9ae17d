"""Run a :class:`~megarl.rollout.reshard.plan.ReshardPlan`: stream its buckets into the engine.

Collective: every rank calls :func:`stream_buckets` (from Megatron:
:func:`~megarl.rollout.reshard.megatron_sync.sync_weights`) with its own shards and the same
plan. Per bucket, one flat buffer: the owning stage's ranks fill it (TP shards all-gathered and
written in the HF layout by :func:`write_hf_from_shards`; experts by their EP rank, then
broadcast over the EP group); with PP > 1 each rank of another stage receives only the slices
its vLLM TP rank loads (:class:`_PipelineRoute`); every rank then hands the bucket's HF-named,
full-shaped views to the engine. Full-shaped because vLLM's ``load_weights`` takes full HF
tensors and narrows them itself; only those slices are defined on other stages' ranks, so
:func:`~megarl.rollout.reshard.vllm_layout.rollout_slice` must mirror vLLM's rule. Extra memory
per rank: one bucket plus one all-gather or message buffer (``plan.peak_bytes``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from megarl.config.model_dims import ModelDims
from megarl.models import hf_mapping as hm
from megarl.rollout.base import WeightSink
from megarl.rollout.reshard.plan import (
    Bucket,
    HFSlot,
    ParamTransfer,
    ReshardPlan,
    SlicePiece,
)

__all__ = [
    "SyncStats",
    "WeightSink",
    "pack_pieces",
    "piece_of",
    "piece_view",
    "rollout_rank_of",
    "slot_view",
    "stream_buckets",
    "unpack_pieces",
    "write_hf_from_shards",
]


@dataclass
class SyncStats:
    """What one sync moved on this rank. Received bytes are counted from the buffers passed to
    the collectives, so they equal :meth:`~megarl.rollout.reshard.plan.ReshardPlan.received`."""

    buckets: int
    bytes: int
    """Bytes of bucket buffers handed to the engine (every rank: the whole model, full-shaped;
    on a rank of another stage only its vLLM TP rank's slices in them were received)."""
    gathered_bytes: int
    """Full bytes of the parameters this rank all-gathered over TP (owner stages only)."""
    seconds: float
    pipeline_received_bytes: int = 0
    """Bytes this rank received from other pipeline stages (its slices)."""
    tp_received_bytes: int = 0
    """Bytes this rank received in TP all-gathers (the other ranks' shards)."""
    ep_received_bytes: int = 0
    """Bytes of the other expert-parallel ranks' experts this rank received (MoE)."""

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else float("inf")


def slot_view(flat: Tensor, slot: HFSlot) -> Tensor:
    """The HF tensor ``slot`` inside a bucket buffer (a view)."""
    return flat[slot.offset : slot.offset + slot.numel].view(slot.shape)


def piece_view(flat: Tensor, piece: SlicePiece) -> Tensor:
    """The rows / columns of ``piece`` inside a bucket buffer (a view, strided for columns)."""
    return piece_of(slot_view(flat, piece.slot), piece)


def piece_of(whole: Tensor, piece: SlicePiece) -> Tensor:
    """The rows / columns of ``piece`` in its slot's whole tensor (a view)."""
    if piece.dim is None:
        return whole
    return whole.narrow(piece.dim, piece.start, piece.stop - piece.start)


def pack_pieces(flat: Tensor, pieces: Sequence[SlicePiece], out: Tensor) -> None:
    """Copy ``pieces`` of the bucket ``flat`` one after another into the message ``out``."""
    at = 0
    for piece in pieces:
        out[at : at + piece.numel].view(piece.shape).copy_(piece_view(flat, piece))
        at += piece.numel


def unpack_pieces(message: Tensor, pieces: Sequence[SlicePiece], flat: Tensor) -> None:
    """Inverse of :func:`pack_pieces`: write the message's pieces at their places in ``flat``."""
    at = 0
    for piece in pieces:
        piece_view(flat, piece).copy_(message[at : at + piece.numel].view(piece.shape))
        at += piece.numel


def rollout_rank_of(global_rank: int, rollout_tp: int) -> int:
    """vLLM TP rank of a process: with ``external_launcher`` each block of ``rollout_tp``
    consecutive ranks is one vLLM TP group (:class:`~megarl.rollout.vllm_engine.VLLMEngine`)."""
    return global_rank % rollout_tp


# --------------------------------------------------------------------------------------------
# Megatron layout -> HF layout, written into the bucket
# --------------------------------------------------------------------------------------------


def write_hf_from_shards(
    name: str, shards: Tensor, dims: ModelDims, out: Mapping[str, Tensor]
) -> None:
    """Write the HF tensors of Megatron parameter ``name`` from its stacked TP shards.

    Args:
        name: global Megatron name (local or TE spec).
        shards: ``[tp, *shard_shape]``, rank order (``full.unsqueeze(0)`` at TP 1 or for a
            replicated parameter).
        out: HF name -> destination tensor of the HF shape (views into a bucket), as named by
            :func:`~megarl.models.hf_mapping.megatron_param_sources`.

    Same result as ``megatron_param_to_hf(name, tp_merge(name, list(shards), dims), dims)``,
    written as strided copies straight into ``out``: merging and splitting would allocate two or
    three full-size temporaries per parameter.
    """
    kind = hm.tp_partition_kind(name)
    tp = shards.shape[0]
    sources = hm.megatron_param_sources(name, dims)
    dests = [out[s] for s in sources]
    if kind == "replicated":
        dests[0].copy_(shards[0])
        return
    if kind == "row":  # split along the input dim: dest[r, k·c + j] = shards[k, r, j]
        rows, cols = shards.shape[1], shards.shape[2]
        dests[0].view(rows, tp, cols).copy_(shards.permute(1, 0, 2))
        return
    if kind == "fc1":  # each shard is [gate_k; up_k]
        half = shards.shape[1] // 2
        stacked = shards.view(tp, 2, half, *shards.shape[2:])
        for i, dest in enumerate(dests):  # gate, up
            dest.view(tp, half, *dest.shape[1:]).copy_(stacked[:, i])
        return
    full = shards.reshape(tp * shards.shape[1], *shards.shape[2:])  # a view: dim-0 chunks
    if kind == "vocab":
        dests[0].copy_(full[: dims.vocab_size])
        return
    # column: linear_qkv, interleaved per KV group as [q heads of g; k_g; v_g]
    d, groups = dims.head_dim, dims.num_query_groups
    qd = dims.heads_per_group * d
    rest = full.shape[1:]
    grouped = full.view(groups, qd + 2 * d, *rest)
    q, k, v = dests
    q.view(groups, qd, *rest).copy_(grouped[:, :qd])
    k.view(groups, d, *rest).copy_(grouped[:, qd : qd + d])
    v.view(groups, d, *rest).copy_(grouped[:, qd + d :])


def _fill_param(
    flat: Tensor,
    transfer: ParamTransfer,
    shard: Tensor,
    dims: ModelDims,
    tp: int,
    tp_group: dist.ProcessGroup | None,
) -> int:
    """Gather (if split over TP: ``tp`` ranks of ``tp_group``, expert TP for experts) and write
    one parameter's HF tensors into the bucket; returns the bytes received in the all-gather."""
    shard = shard.detach()
    if tuple(shard.shape) != transfer.shard_shape:
        raise ValueError(
            f"{transfer.name}: local shard {tuple(shard.shape)} != planned "
            f"{transfer.shard_shape} (plan made for another layout or model?)"
        )
    if transfer.gathers_into_bucket:
        (slot,) = transfer.slots
        region = flat[slot.offset : slot.offset + slot.span].view(transfer.shape)
        dist.all_gather_into_tensor(region, shard.contiguous(), group=tp_group)
        return region.nbytes - shard.nbytes
    received = 0
    if transfer.needs_gather:
        rows = (tp * transfer.shard_shape[0], *transfer.shard_shape[1:])
        gathered = torch.empty(rows, dtype=shard.dtype, device=shard.device)
        dist.all_gather_into_tensor(gathered, shard.contiguous(), group=tp_group)
        received = gathered.nbytes - shard.nbytes
        stacked = gathered.view(tp, *transfer.shard_shape)
    else:
        stacked = shard.unsqueeze(0)
    write_hf_from_shards(
        transfer.name, stacked, dims, {s.name: slot_view(flat, s) for s in transfer.slots}
    )
    return received


# --------------------------------------------------------------------------------------------
# The bucket loop
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def stream_buckets(
    params: Mapping[str, Tensor],
    plan: ReshardPlan,
    sink: WeightSink,
    *,
    pp_rank: int = 0,
    tp_group: dist.ProcessGroup | None = None,
    pp_group: dist.ProcessGroup | None = None,
    ep_rank: int = 0,
    ep_group: dist.ProcessGroup | None = None,
    etp_group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
    rollout_rank: int | None = None,
    fill_unsent: float | None = None,
) -> SyncStats:
    """Run the plan with explicit process groups (no Megatron needed).

    Args:
        params: this rank's TP shards of its stage's parameters, by global Megatron name.
        plan: the same plan on every rank.
        sink: the engine, or anything with its weight-update session
            (:class:`~megarl.rollout.base.WeightSink`). An engine that reports
            ``tensor_parallel_size`` / ``tp_rank`` must match the plan and ``rollout_rank``.
        pp_rank: this rank's pipeline stage (its rank in ``pp_group``).
        tp_group / pp_group: the TP and PP groups of this rank (unused at size 1).
        ep_rank / ep_group / etp_group: this rank's expert-parallel rank, its EP and expert-TP
            groups (MoE; unused at size 1).
        device: where bucket buffers live (default: the parameters' device).
        rollout_rank: this rank's vLLM TP rank (default: :func:`rollout_rank_of` its global
            rank); the PP group's other members are placed by the same rule.
        fill_unsent: with PP > 1, set every bucket element this rank does not receive from
            another stage to this value first (tests: NaN, to prove the engine never reads
            them); None leaves them undefined.
    """
    pp = plan.layout.pp
    if device is None:
        device = next(iter(params.values())).device if params else torch.device("cpu")
    for name, p in params.items():
        if p.dtype != plan.dtype:
            raise TypeError(f"{name} is {p.dtype}, the plan was made for {plan.dtype}")
    if rollout_rank is None:
        distributed = dist.is_available() and dist.is_initialized()
        rollout_rank = rollout_rank_of(dist.get_rank(), plan.rollout_tp) if distributed else 0
    _check_sink(sink, plan, rollout_rank)
    route = _PipelineRoute(pp_group, pp_rank, plan.rollout_tp, rollout_rank) if pp > 1 else None
    start = time.perf_counter()
    moved = gathered = tp_received = pp_received = ep_received = 0
    spare: _Buffer | None = None
    sink.begin_weight_update()
    for bucket in plan.buckets:
        owner = bucket.pp_rank == pp_rank
        transient = max(bucket.scratch_bytes if owner else 0, bucket.pack_numel * plan.itemsize)
        if (
            spare is not None
            and spare.tensor.numel() >= bucket.numel
            and spare.tensor.nbytes + transient <= plan.peak_bytes  # keep within the plan's bound
        ):
            buffer, spare = spare, None
        else:
            spare = None  # release a too-small spare before allocating
            buffer = _Buffer(torch.empty(bucket.numel, dtype=plan.dtype, device=device))
        flat = buffer.tensor[: bucket.numel]
        if owner:
            for transfer in bucket.params:
                if transfer.ep_rank not in (None, ep_rank):
                    continue  # another EP rank's expert: arrives by broadcast below
                expert = transfer.ep_rank is not None
                tp_received += _fill_param(
                    flat,
                    transfer,
                    params[transfer.name],
                    plan.dims,
                    plan.split_size(transfer),
                    etp_group if expert else tp_group,
                )
                gathered += transfer.nbytes if transfer.needs_gather else 0
            for k, lo, hi in bucket.expert_runs:
                dist.broadcast(flat[lo:hi], src=dist.get_global_rank(ep_group, k), group=ep_group)
                ep_received += (hi - lo) * plan.itemsize if k != ep_rank else 0
        if route is not None:
            pp_received += route.move(bucket, flat, fill_unsent)
        sink.load_weight_chunk([(s.name, slot_view(flat, s)) for s in bucket.slots])
        moved += bucket.nbytes
        del flat
        if buffer.unshared():
            spare = buffer
        del buffer
    del spare
    sink.finish_weight_update()
    return SyncStats(
        len(plan.buckets),
        moved,
        gathered,
        time.perf_counter() - start,
        pipeline_received_bytes=pp_received,
        tp_received_bytes=tp_received,
        ep_received_bytes=ep_received,
    )


def _check_sink(sink: WeightSink, plan: ReshardPlan, rollout_rank: int) -> None:
    """A plan for another vLLM TP size would send ranks the wrong slices: refuse it."""
    size = getattr(sink, "tensor_parallel_size", None)
    if size is not None and size != plan.rollout_tp:
        raise ValueError(
            f"the engine runs TP={size}, the plan was made for rollout TP={plan.rollout_tp}"
        )
    rank = getattr(sink, "tp_rank", None)
    if rank is not None and rank != rollout_rank:
        raise ValueError(f"the engine is TP rank {rank}, the executor assumed {rollout_rank}")
    # At PP 1 every rank has whole buckets and either expert layout loads; at PP > 1 a rank
    # receives only the expert slices of the plan's layout, and the other layout reads unsent rows.
    ep = getattr(sink, "expert_parallel", None)
    if ep is not None and plan.layout.pp > 1 and bool(ep) != plan.rollout_ep:
        raise ValueError(
            f"the engine runs expert_parallel={bool(ep)}, the plan was made for "
            f"rollout_ep={plan.rollout_ep}"
        )


class _PipelineRoute:
    """How a bucket reaches the other ranks of this rank's PP group: one broadcast when they
    all load the same vLLM TP rank's slices, else one message per receiver from the owner.

    Megatron numbers ranks TP-first, so a PP group shares one vLLM TP rank (``rank % TP_v``)
    whenever the ranks of one stage (TP × DP × CP) are a multiple of the vLLM TP size. A message
    that is one contiguous run of the bucket travels in place; others are packed.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        stage: int,
        rollout_tp: int,
        rollout_rank: int,
    ) -> None:
        size = dist.get_world_size(group)
        self.group = group
        self.stage = stage
        self.members = [dist.get_global_rank(group, i) for i in range(size)]
        self.rollout = [rollout_rank_of(g, rollout_tp) for g in self.members]
        if self.rollout[stage] != rollout_rank:
            raise ValueError(
                f"rollout rank {rollout_rank} given, {self.rollout[stage]} by the rank rule"
            )
        self.uniform = len(set(self.rollout)) == 1

    def move(self, bucket: Bucket, flat: Tensor, fill: float | None) -> int:
        """Deliver ``bucket`` from its owner stage; returns the bytes this rank received."""
        src = self.members[bucket.pp_rank]
        if bucket.pp_rank == self.stage:  # the owner: send
            receivers = [k for k in range(len(self.members)) if k != self.stage]
            if self.uniform:
                message = _message(bucket, self.rollout[self.stage], flat, pack=True)
                if message is not None:
                    dist.broadcast(message, src=src, group=self.group)
                return 0
            for v in sorted({self.rollout[k] for k in receivers}):
                message = _message(bucket, v, flat, pack=True)
                if message is None:
                    continue
                works = [
                    dist.isend(message, dst=self.members[k], group=self.group)
                    for k in receivers
                    if self.rollout[k] == v
                ]
                for work in works:
                    work.wait()
                del message, works  # one message buffer at a time (the plan's bound)
            return 0
        if fill is not None:
            flat.fill_(fill)
        v = self.rollout[self.stage]
        message = _message(bucket, v, flat, pack=False)
        if message is None:
            return 0
        if self.uniform:
            dist.broadcast(message, src=src, group=self.group)
        else:
            dist.recv(message, src=src, group=self.group)
        if bucket.message_range(v) is None:
            unpack_pieces(message, bucket.slices[v], flat)
        return message.nbytes


def _message(bucket: Bucket, v: int, flat: Tensor, *, pack: bool) -> Tensor | None:
    """The message for vLLM TP rank ``v``: a view of ``flat`` when its pieces are one run of
    it, else a new buffer (filled from ``flat`` when ``pack``); None when it is empty."""
    numel = bucket.message_numel(v)
    if numel == 0:
        return None
    run = bucket.message_range(v)
    if run is not None:
        return flat[run[0] : run[1]]
    message = torch.empty(numel, dtype=flat.dtype, device=flat.device)
    if pack:
        pack_pieces(flat, bucket.slices[v], message)
    return message


class _Buffer:
    """A bucket buffer that is reused for the next bucket only when nothing else references its
    memory any more.

    Reuse saves the page faults of a fresh host allocation, but the engine may keep views of a
    bucket past ``load_weight_chunk`` (vLLM holds a module whose padded rows were not all loaded
    until the update finishes) and a finished collective may still hold it for a moment; such a
    buffer is left to them and a new one is allocated. Whether others hold it is read from the
    storage's reference count.
    """

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor
        self._alone = _storage_use_count(tensor)

    def unshared(self) -> bool:
        count = _storage_use_count(self.tensor)
        return count is not None and count == self._alone


def _storage_use_count(tensor: Tensor) -> int | None:
    # Private on purpose: torch 2.13 has no public count of the tensors sharing a storage. A
    # weakref to the buffer (public) misses memory shared without a view of it (``.numpy()``,
    # a tensor ``set_`` on its storage), and reusing such a buffer would overwrite weights the
    # engine still reads. If the private function goes away, buffers are simply not reused.
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:  # never reuse when it cannot be checked
        return None
    return int(use_count(tensor.untyped_storage()._cdata))
