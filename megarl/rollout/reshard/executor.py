"""Execute a :class:`~megarl.rollout.reshard.plan.ReshardPlan`: stream buckets into vLLM.

Collective over the whole world: every rank calls :func:`sync_weights` with its own model chunks
and the same plan. Per bucket:

1. every rank takes a flat buffer for the bucket (``bucket.nbytes``; the previous bucket's when
   it is large enough, nobody else holds it and the plan's bound allows, else a new one);
2. the ranks of the owning pipeline stage fill it: each parameter's TP shards are all-gathered
   (skipped at training TP 1) and rearranged into the Hugging Face layout with strided copies
   straight into the buffer (vocab-parallel shards are gathered in place);
3. with PP > 1 the owner stage broadcasts the buffer over each PP group (DP replicas and TP
   ranks each use their own PP group, so every rank ends up with it);
4. every rank hands the bucket's HF-named views to its engine (``load_weight_chunk``), which
   slices what its vLLM TP rank needs (KV heads replicated by vLLM when TP_v > KV heads);
5. the buffer is released (or kept for the next bucket) before the next bucket is filled.

Extra memory on a rank is therefore one bucket plus, on owner ranks, one parameter's all-gather
buffer (``plan.peak_bytes``), whatever the model size. vLLM holds back a module's tensors until
the whole module has arrived, so the plan keeps modules whole inside a bucket; it may hold the
embedding / output layer until the update finishes (padded vocabulary rows), which is why those
travel alone and why a buffer still referenced by anyone is never reused.

Not done (yet): the shard-only fast path (training TP == vLLM TP, PP 1: hand each rank only its
own shard, no gather). vLLM's ``load_weights`` takes full HF tensors, so that path needs a
direct write into vLLM's (on CPU repacked) parameters; the all-gather it would save is small
next to vLLM's own load on the sizes measured here.

Why the layout change is written here as strided copies rather than by calling
:func:`megarl.models.hf_mapping.megatron_param_to_hf` on a merged tensor: merging and splitting
allocate two or three full-size temporaries per parameter (7 GiB for a 72B embedding at TP 8);
:func:`write_hf_from_shards` writes the same result into the bucket with at most the gather
buffer. Tests check it against ``hf_mapping`` for every partition kind and several TP sizes.
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
from megarl.parallel.layout import ParallelLayout
from megarl.rollout.base import WeightSink
from megarl.rollout.reshard.plan import (
    DEFAULT_BUCKET_BYTES,
    HFSlot,
    ParamTransfer,
    ReshardPlan,
    make_reshard_plan,
)

__all__ = [
    "SyncStats",
    "WeightSink",
    "plan_for_chunks",
    "slot_view",
    "stream_buckets",
    "sync_weights",
    "write_hf_from_shards",
]


@dataclass
class SyncStats:
    """What one sync moved on this rank."""

    buckets: int
    bytes: int
    """Bytes of bucket buffers handed to the engine (every rank: the whole model)."""
    gathered_bytes: int
    """Full bytes of the parameters this rank all-gathered over TP (owner stages only)."""
    seconds: float

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else float("inf")


def slot_view(flat: Tensor, slot: HFSlot) -> Tensor:
    """The HF tensor ``slot`` inside a bucket buffer (a view)."""
    return flat[slot.offset : slot.offset + slot.numel].view(slot.shape)


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

    Same result as ``megatron_param_to_hf(name, tp_merge(name, list(shards), dims), dims)``
    without building the merged tensor.
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
) -> None:
    """Gather (if split over TP) and write one parameter's HF tensors into the bucket."""
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
        return
    if transfer.needs_gather:
        rows = (tp * transfer.shard_shape[0], *transfer.shard_shape[1:])
        gathered = torch.empty(rows, dtype=shard.dtype, device=shard.device)
        dist.all_gather_into_tensor(gathered, shard.contiguous(), group=tp_group)
        stacked = gathered.view(tp, *transfer.shard_shape)
    else:
        stacked = shard.unsqueeze(0)
    write_hf_from_shards(
        transfer.name, stacked, dims, {s.name: slot_view(flat, s) for s in transfer.slots}
    )


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
    device: torch.device | str | None = None,
) -> SyncStats:
    """Run the plan with explicit process groups (no Megatron needed).

    Args:
        params: this rank's TP shards of its stage's parameters, by global Megatron name.
        plan: the same plan on every rank.
        sink: the engine, or anything with its weight-update session
            (:class:`~megarl.rollout.base.WeightSink`).
        pp_rank: this rank's pipeline stage (its rank in ``pp_group``).
        tp_group / pp_group: the TP and PP groups of this rank (unused at size 1).
        device: where bucket buffers live (default: the parameters' device).
    """
    tp, pp = plan.layout.tp, plan.layout.pp
    if device is None:
        device = next(iter(params.values())).device if params else torch.device("cpu")
    for name, p in params.items():
        if p.dtype != plan.dtype:
            raise TypeError(f"{name} is {p.dtype}, the plan was made for {plan.dtype}")
    start = time.perf_counter()
    moved = gathered = 0
    spare: _Buffer | None = None
    sink.begin_weight_update()
    for bucket in plan.buckets:
        scratch = bucket.scratch_bytes if bucket.pp_rank == pp_rank else 0
        if (
            spare is not None
            and spare.tensor.numel() >= bucket.numel
            and spare.tensor.nbytes + scratch <= plan.peak_bytes  # keep within the plan's bound
        ):
            buffer, spare = spare, None
        else:
            spare = None  # release a too-small spare before allocating
            buffer = _Buffer(torch.empty(bucket.numel, dtype=plan.dtype, device=device))
        flat = buffer.tensor[: bucket.numel]
        if bucket.pp_rank == pp_rank:
            for transfer in bucket.params:
                _fill_param(flat, transfer, params[transfer.name], plan.dims, tp, tp_group)
            gathered += bucket.gathered_bytes
        if pp > 1:
            src = dist.get_global_rank(pp_group, bucket.pp_rank)
            dist.broadcast(flat, src=src, group=pp_group)
        sink.load_weight_chunk([(s.name, slot_view(flat, s)) for s in bucket.slots])
        moved += bucket.nbytes
        del flat
        if buffer.unshared():
            spare = buffer
        del buffer
    del spare
    sink.finish_weight_update()
    return SyncStats(len(plan.buckets), moved, gathered, time.perf_counter() - start)


class _Buffer:
    """A bucket buffer that is reused for the next bucket only when nothing else references its
    memory any more.

    Fresh host allocations cost page faults (measured: 3.4 GB/s for fresh buckets against 16
    GB/s reused), but the engine may keep views of a bucket past ``load_weight_chunk`` (vLLM
    holds a module whose padded rows were not all loaded until the update finishes) and a
    finished collective may still hold it for a moment; such a buffer is left to them and a new
    one is allocated. Whether others hold it is read from the storage's reference count.
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


# --------------------------------------------------------------------------------------------
# Megatron entry points
# --------------------------------------------------------------------------------------------


def plan_for_chunks(
    chunks: Sequence[torch.nn.Module],
    dims: ModelDims,
    rollout_tp: int,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> ReshardPlan:
    """The plan for this actor: layout from its ``TransformerConfig``, dtype from its weights."""
    from megarl.models.gpt import unwrap

    model = unwrap(chunks[0])
    cfg = model.config
    vpp = cfg.virtual_pipeline_model_parallel_size
    layout = ParallelLayout(
        cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, vpp if vpp else None
    )
    dtype = next(model.parameters()).dtype
    return make_reshard_plan(dims, layout, rollout_tp, bucket_bytes=bucket_bytes, dtype=dtype)


def local_params_for_plan(
    chunks: Sequence[torch.nn.Module], plan: ReshardPlan
) -> tuple[dict[str, Tensor], int]:
    """This rank's parameters by global name, checked against the plan's ownership.

    Raises ``ValueError`` when Megatron put a parameter on another stage / chunk than the plan
    (different layer split), or a planned parameter of this stage is missing.
    """
    from megatron.core import parallel_state

    from megarl.models.weights import local_global_names

    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    params: dict[str, Tensor] = {}
    for chunk_index, _local, name, param in local_global_names(chunks):
        transfer = plan.params.get(name)
        if transfer is None:
            if name in plan.skipped:
                continue
            raise ValueError(
                f"{name} (stage {pp_rank}, chunk {chunk_index}) is not in the plan: a critic's "
                "value head, or a plan made for another model?"
            )
        if (transfer.pp_rank, transfer.vp_stage) != (pp_rank, chunk_index):
            raise ValueError(
                f"{name}: Megatron holds it on stage {pp_rank} chunk {chunk_index}, the plan on "
                f"stage {transfer.pp_rank} chunk {transfer.vp_stage}"
            )
        params[name] = param
    missing = [n for n, t in plan.params.items() if t.pp_rank == pp_rank and n not in params]
    if missing:
        raise ValueError(f"stage {pp_rank} lacks planned parameters {missing[:4]}")
    return params, pp_rank


def sync_weights(
    chunks: Sequence[torch.nn.Module], plan: ReshardPlan, sink: WeightSink
) -> SyncStats:
    """Push the actor's weights into the rollout engine (collective: every rank calls it).

    ``chunks`` are this rank's model chunks (plain or DDP-wrapped); ``plan`` must match the
    current Megatron layout (see :func:`plan_for_chunks`). Afterwards the engine holds exactly
    the actor's weights and has dropped its prefix cache.
    """
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if (tp, pp) != (plan.layout.tp, plan.layout.pp):
        raise ValueError(
            f"plan is for TP={plan.layout.tp}, PP={plan.layout.pp}; running TP={tp}, PP={pp}"
        )
    params, pp_rank = local_params_for_plan(chunks, plan)
    stats = stream_buckets(
        params,
        plan,
        sink,
        pp_rank=pp_rank,
        tp_group=parallel_state.get_tensor_model_parallel_group() if tp > 1 else None,
        pp_group=parallel_state.get_pipeline_model_parallel_group() if pp > 1 else None,
    )
    return stats
