"""Pure resharding plan: where each Megatron parameter lives and how it travels to vLLM.

Computed from the model dimensions, the training layout (TP, PP, VPP, EP, ETP) and the rollout
TP alone (no ``torch.distributed``, no Megatron, no tensors) and deterministic, so every rank
computes the same plan; :mod:`~megarl.rollout.reshard.executor` moves the bytes by it.

A plan is ordered :class:`Bucket` s, each a flat buffer of at most ``bucket_bytes`` holding the
HF tensors of whole modules of one pipeline stage: vLLM processes a module only once all its
tensors have arrived (a layer's experts are one module, vLLM's ``FusedMoE``). A larger module is
a bucket of its own; the embedding and output layer travel alone, as vLLM may hold them until
the update finishes (padded vocabulary rows). With PP > 1 a rank receives only its vLLM TP
rank's :class:`SlicePiece` s of other stages' buckets (:func:`rollout_slice`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

import torch

from megarl.config.model_dims import ModelDims
from megarl.models import hf_mapping as hm
from megarl.parallel.layout import (
    ParallelLayout,
    layer_chunk,
    pipeline_split_problems,
    shape_layout_problems,
)
from megarl.parallel.layout import chunk_layer_range as layout_chunk_layer_range
from megarl.rollout.reshard.vllm_layout import (
    rollout_expert_range,
    rollout_shard_shape,
    rollout_slice,
)

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "Bucket",
    "HFSlot",
    "ParamTransfer",
    "RankTraffic",
    "ReshardPlan",
    "SlicePiece",
    "check_rollout_tp",
    "chunk_layer_range",
    "owner_of",
    "require_training_layout",
    "rollout_expert_range",
    "rollout_shard_shape",
    "rollout_slice",
]

DEFAULT_BUCKET_BYTES = 1 << 30
"""1 GiB: about half a layer of a 72B model in bf16 (its ``linear_fc1``, 0.9 GiB, still fits;
``megarl plan`` prints the numbers of a given model)."""


@dataclass(frozen=True)
class HFSlot:
    """One Hugging Face tensor inside a bucket's flat buffer."""

    name: str
    shape: tuple[int, ...]
    offset: int
    """First element in the bucket buffer."""
    reserved: int = 0
    """Elements set aside from ``offset`` (0: just ``numel``). A vocab-parallel tensor gathered
    over TP reserves its padded rows: the all-gather writes straight into the bucket and the
    slot is the first ``vocab_size`` rows of that region."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def span(self) -> int:
        """Elements of the bucket this slot occupies."""
        return max(self.reserved, self.numel)


@dataclass(frozen=True)
class SlicePiece:
    """The part of one HF tensor that one vLLM TP rank loads: indices ``[start, stop)`` along
    ``dim`` of the slot's tensor (``dim`` None: the whole tensor)."""

    slot: HFSlot
    dim: int | None
    start: int = 0
    stop: int = 0

    @property
    def shape(self) -> tuple[int, ...]:
        if self.dim is None:
            return self.slot.shape
        shape = list(self.slot.shape)
        shape[self.dim] = self.stop - self.start
        return tuple(shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def flat_range(self) -> tuple[int, int] | None:
        """Elements ``[first, end)`` of the bucket it occupies when they are contiguous (the
        whole tensor, or a dim-0 range); None for a column range of a matrix."""
        row = math.prod(self.slot.shape[1:])
        if self.dim is None:
            return self.slot.offset, self.slot.offset + self.slot.numel
        if self.dim == 0 or self.slot.shape[0] == 1:
            lead = row if self.dim == 0 else 1
            return self.slot.offset + self.start * lead, self.slot.offset + self.stop * lead
        return None


@dataclass(frozen=True)
class ParamTransfer:
    """How one full Megatron parameter gets from its training shards into a bucket."""

    name: str
    """Global Megatron name (local-spec, global layer index)."""
    pp_rank: int
    """Pipeline stage that holds it."""
    vp_stage: int
    """Model chunk on that stage (0 without VPP)."""
    partition: hm.PartitionKind
    """TP partition kind (``column``, ``row``, ``fc1``, ``vocab``, ``replicated``)."""
    shape: tuple[int, ...]
    """Full Megatron shape (vocab rows padded)."""
    shard_shape: tuple[int, ...]
    """Shape held by one training TP rank."""
    needs_gather: bool
    """True when training TP > 1 and the parameter is split: its shards are all-gathered."""
    slots: tuple[HFSlot, ...]
    """The Hugging Face tensors it becomes (none for a tied output layer)."""
    itemsize: int
    ep_rank: int | None = None
    """MoE experts: the expert-parallel rank holding it (each holds ``E/EP`` consecutive
    experts, Megatron's rule; ``shard_shape`` and ``needs_gather`` then refer to expert TP).
    None: every rank of its stage holds it."""

    @property
    def nbytes(self) -> int:
        """Bytes of the full Megatron parameter."""
        return math.prod(self.shape) * self.itemsize

    @property
    def hf_bytes(self) -> int:
        """Bytes of its Hugging Face tensors (vocab padding trimmed)."""
        return sum(s.numel for s in self.slots) * self.itemsize

    @property
    def span_bytes(self) -> int:
        """Bytes of the bucket it occupies (``hf_bytes`` plus any reserved padding rows)."""
        return sum(s.span for s in self.slots) * self.itemsize

    @property
    def gathers_into_bucket(self) -> bool:
        """Vocab-parallel shards are all-gathered straight into the bucket (the gathered rows
        are already the HF layout plus padding)."""
        return self.needs_gather and self.partition == "vocab"

    @property
    def scratch_bytes(self) -> int:
        """Transient memory on an owner rank while this parameter is converted: the all-gather
        buffer (1× full) for gathered non-vocab parameters, nothing otherwise (the layout change
        is a strided copy from the shards into the bucket)."""
        return self.nbytes if self.needs_gather and not self.gathers_into_bucket else 0


@dataclass(frozen=True)
class Bucket:
    """A group of whole modules of one pipeline stage, moved as one flat buffer."""

    index: int
    pp_rank: int
    """The stage whose ranks fill it (the other stages' ranks receive their slices of it)."""
    params: tuple[ParamTransfer, ...]
    numel: int
    """Elements of the flat buffer."""
    itemsize: int
    slices: tuple[tuple[SlicePiece, ...], ...] = ()
    """Per vLLM TP rank: the non-empty pieces of this bucket's HF tensors that rank loads, in
    slot order. Their concatenation is the message a rank of another stage receives."""
    pack_numel: int = 0
    """Elements of the separate message buffer a pipeline transfer of this bucket needs (the
    largest message that is not one contiguous range of the bucket; 0 at PP 1)."""
    expert_runs: tuple[tuple[int, int, int], ...] = ()
    """``(ep_rank, start, stop)``: bucket elements ``[start, stop)`` written by that
    expert-parallel rank's ranks and broadcast to the EP group (empty at EP 1)."""

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def message_numel(self, rollout_rank: int) -> int:
        """Elements another stage sends to a rank of vLLM TP rank ``rollout_rank``."""
        return sum(p.numel for p in self.slices[rollout_rank])

    def message_range(self, rollout_rank: int) -> tuple[int, int] | None:
        """The bucket elements ``[first, end)`` that are this rank's message when its pieces
        are one contiguous run (then it travels in place, no packing); else None."""
        ranges = [p.flat_range() for p in self.slices[rollout_rank]]
        if not ranges or any(r is None for r in ranges):
            return None
        first, end = ranges[0]
        for lo, hi in ranges[1:]:
            if lo != end:
                return None
            end = hi
        return first, end

    @property
    def scratch_bytes(self) -> int:
        """Largest per-parameter transient on an owner rank (``ParamTransfer.scratch_bytes``)."""
        return max((p.scratch_bytes for p in self.params), default=0)

    @property
    def peak_bytes(self) -> int:
        """Upper bound of extra memory on a rank while this bucket is in flight: the bucket,
        plus the all-gather scratch while it is filled or the message buffer while it travels
        (never both at once)."""
        return self.nbytes + max(self.scratch_bytes, self.pack_numel * self.itemsize)

    @property
    def gathered_bytes(self) -> int:
        """Full bytes of the parameters all-gathered over TP for this bucket."""
        return sum(p.nbytes for p in self.params if p.needs_gather)

    @property
    def slots(self) -> list[HFSlot]:
        return [s for p in self.params for s in p.slots]


@dataclass(frozen=True)
class RankTraffic:
    """Bytes one rank receives in one sync."""

    pipeline: int
    """Its vLLM TP rank's slices of the other pipeline stages' buckets."""
    tp_gather: int
    """The other training-TP ranks' shards of its own stage's split parameters (the all-gather
    is not sliced: owner ranks assemble full parameters); for experts, the other expert-TP
    ranks' shards of its own EP rank's experts."""
    ep_broadcast: int = 0
    """The other expert-parallel ranks' experts of its own stage, whole."""

    @property
    def total(self) -> int:
        return self.pipeline + self.tp_gather + self.ep_broadcast


@dataclass(frozen=True)
class ReshardPlan:
    """Megatron (TP, PP, VPP, EP, ETP) → vLLM TP weight transfer, as ordered buckets."""

    dims: ModelDims
    layout: ParallelLayout
    rollout_tp: int
    bucket_bytes: int
    dtype: torch.dtype
    """Element type of the parameters and of the bucket buffers."""
    buckets: tuple[Bucket, ...]
    skipped: tuple[str, ...] = field(default=())
    """Megatron parameters that produce no HF tensor (the tied output-layer copy on the last
    stage when PP > 1)."""
    rollout_ep: bool = False
    """vLLM runs expert parallelism (EP size = its TP size): each rank keeps whole experts, its
    own only; its engine still gets every expert and skips the others, and its slices from
    other stages hold only its own experts."""

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @cached_property
    def params(self) -> dict[str, ParamTransfer]:
        return {p.name: p for b in self.buckets for p in b.params}

    @property
    def total_bytes(self) -> int:
        """Bytes of all bucket buffers (the HF tensors plus the vocab padding rows that are
        gathered in place): what every rank hands its engine, full-shaped (on a rank of another
        stage only its slices in them were received)."""
        return sum(b.nbytes for b in self.buckets)

    @property
    def hf_bytes(self) -> int:
        """Bytes of all Hugging Face tensors."""
        return sum(p.hf_bytes for p in self.params.values())

    @property
    def gathered_bytes(self) -> int:
        """Full bytes of all parameters that are TP-gathered."""
        return sum(b.gathered_bytes for b in self.buckets)

    @property
    def peak_bytes(self) -> int:
        """Upper bound of a sync's extra memory on any rank: the largest
        :attr:`Bucket.peak_bytes` (a bucket plus its all-gather scratch or message buffer)."""
        return max((b.peak_bytes for b in self.buckets), default=0)

    def bytes_per_stage(self) -> list[int]:
        """Bytes of the HF tensors each pipeline stage produces."""
        out = [0] * self.layout.pp
        for b in self.buckets:
            out[b.pp_rank] += b.nbytes
        return out

    def received(self, pp_rank: int, rollout_rank: int, ep_rank: int = 0) -> RankTraffic:
        """Bytes a rank of stage ``pp_rank``, vLLM TP rank ``rollout_rank`` and expert-parallel
        rank ``ep_rank`` receives per sync (what
        :class:`~megarl.rollout.reshard.executor.SyncStats` counts on that rank)."""
        if not 0 <= rollout_rank < self.rollout_tp:
            raise ValueError(f"rollout rank {rollout_rank} outside 0..{self.rollout_tp - 1}")
        if not 0 <= ep_rank < self.layout.ep:
            raise ValueError(f"expert-parallel rank {ep_rank} outside 0..{self.layout.ep - 1}")
        pipeline = 0
        if self.layout.pp > 1:
            pipeline = sum(
                b.message_numel(rollout_rank) for b in self.buckets if b.pp_rank != pp_rank
            )
        own = [p for b in self.buckets if b.pp_rank == pp_rank for p in b.params]
        gather = sum(
            p.nbytes // self.split_size(p) * (self.split_size(p) - 1)
            for p in own
            if p.needs_gather and p.ep_rank in (None, ep_rank)
        )
        experts = sum(p.hf_bytes for p in own if p.ep_rank not in (None, ep_rank))
        return RankTraffic(pipeline * self.itemsize, gather, experts)

    def split_size(self, transfer: ParamTransfer) -> int:
        """The TP size splitting ``transfer`` in training (expert TP for experts)."""
        return self.layout.tp if transfer.ep_rank is None else self.layout.etp

    def full_bytes_from_other_stages(self, pp_rank: int) -> int:
        """Bytes of the other stages' whole buckets: what a rank of ``pp_rank`` would receive
        if buckets crossed stages unsliced (0 at PP 1)."""
        if self.layout.pp == 1:
            return 0
        return sum(b.nbytes for b in self.buckets if b.pp_rank != pp_rank)

    def rollout_slice_bytes(self, rollout_rank: int) -> int:
        """Bytes of the HF data vLLM TP rank ``rollout_rank`` loads (its slices of every
        tensor, replicated ones whole; vLLM's padding rows not counted)."""
        return sum(b.message_numel(rollout_rank) for b in self.buckets) * self.itemsize

    def rollout_bytes_per_rank(self, rollout_rank: int | None = None) -> int:
        """Bytes vLLM TP rank ``rollout_rank`` keeps after slicing (KV heads replicated when
        TP_v > nkv); None: the most any rank keeps (ranks differ only under vLLM EP, where
        ranks below ``E % TP`` hold one expert more)."""
        if rollout_rank is None:
            ranks = range(self.rollout_tp) if self.rollout_ep else range(1)
            return max(self.rollout_bytes_per_rank(v) for v in ranks)
        kept = sum(
            math.prod(
                rollout_shard_shape(
                    s.name,
                    s.shape,
                    self.dims,
                    self.rollout_tp,
                    rollout_ep=self.rollout_ep,
                    rollout_rank=rollout_rank,
                )
            )
            for b in self.buckets
            for s in b.slots
        )
        return kept * self.itemsize

    def summary(self) -> str:
        """A few lines for humans (``megarl plan``)."""
        d, lay = self.dims, self.layout
        mib = 1 << 20
        sizes = sorted(b.nbytes for b in self.buckets) or [0]
        replicated = "  (vLLM replicates KV heads)" if self.rollout_tp > d.num_query_groups else ""
        stages = ", ".join(f"PP{i} {b / mib:.1f}" for i, b in enumerate(self.bytes_per_stage()))
        gathered = self.gathered_bytes / mib if self.gathered_bytes else 0.0
        lines = [
            (
                f"model: {d.architecture}, {d.num_layers} layers, hidden {d.hidden_size}, "
                f"ffn {d.ffn_hidden_size}, heads {d.num_attention_heads}/{d.num_query_groups} "
                f"(q/kv), vocab {d.vocab_size} (padded {d.padded_vocab_size}), "
                f"tied={d.tie_word_embeddings}"
            ),
            (
                f"training TP={lay.tp} PP={lay.pp} VPP={lay.vpp}"
                + (f" EP={lay.ep} ETP={lay.etp}" if d.num_experts else "")
                + f" -> vLLM TP={self.rollout_tp}"
                + (f" EP={self.rollout_tp}" if self.rollout_ep else "")
                + replicated
            ),
            (
                f"tensors: {len(self.params)} Megatron parameters -> "
                f"{sum(len(b.slots) for b in self.buckets)} HF tensors, "
                f"{self.hf_bytes / mib:.1f} MiB ({self.dtype})"
            ),
            (
                f"buckets: {len(self.buckets)}, limit {self.bucket_bytes / mib:.1f} MiB, sizes "
                f"{sizes[0] / mib:.1f}..{sizes[-1] / mib:.1f} MiB (a module over the limit is a "
                "bucket of its own)"
            ),
            f"MiB per stage: {stages}",
            f"TP all-gather: {gathered:.1f} MiB of full parameters (training TP={lay.tp}"
            + (f", expert TP={lay.etp})" if d.num_experts else ")"),
            *self._expert_lines(),
            *self._received_lines(),
            (
                f"peak extra memory per rank: <= {self.peak_bytes / mib:.1f} MiB "
                "(one bucket + one all-gather or message buffer)"
            ),
            f"vLLM keeps per rank: {self.rollout_bytes_per_rank() / mib:.1f} MiB"
            + (" (the most of any rank; experts whole)" if self.rollout_ep else ""),
        ]
        if self.skipped:
            lines.append(f"skipped: {', '.join(self.skipped)} (tied to the embedding)")
        return "\n".join(lines)

    def _expert_lines(self) -> list[str]:
        """EP: the experts each rank receives whole from the other EP ranks of its stage."""
        if self.layout.ep == 1:
            return []
        mib = 1 << 20
        per_rank = [
            self.received(stage, 0, k).ep_broadcast
            for stage in range(self.layout.pp)
            for k in range(self.layout.ep)
        ]
        return [
            (
                f"experts: {self.dims.num_experts} over EP={self.layout.ep}, broadcast in the EP "
                f"group: {max(per_rank) / mib:.1f} MiB received per rank and sync (the other EP "
                "ranks' experts, whole)"
            )
        ]

    def _received_lines(self) -> list[str]:
        """Bytes received per rank, by stage (a range over the vLLM TP ranks)."""
        mib = 1 << 20
        t = self.rollout_tp

        def span(values: list[int]) -> str:
            lo, hi = min(values) / mib, max(values) / mib
            return f"{lo:.1f}" if f"{lo:.1f}" == f"{hi:.1f}" else f"{lo:.1f}..{hi:.1f}"

        slices = [self.rollout_slice_bytes(v) for v in range(t)]
        lines = [
            (
                f"one vLLM TP rank's slices: {span(slices)} MiB of {self.hf_bytes / mib:.1f} "
                f"(1/{t} = {self.hf_bytes / t / mib:.1f}; norms whole"
                + (", KV heads replicated" if t > self.dims.num_query_groups else "")
                + (", experts whole on their vLLM EP rank)" if self.rollout_ep else ")")
            ),
            "received per rank and sync, MiB:",
        ]
        for stage in range(self.layout.pp):
            got = [self.received(stage, v) for v in range(t)]  # EP rank 0's share
            full = self.full_bytes_from_other_stages(stage) / mib
            lines.append(
                f"  PP{stage}: {span([g.pipeline for g in got])} from other stages (unsliced "
                f"{full:.1f}) + {span([g.tp_gather for g in got])} in the TP all-gather"
            )
        return lines


# --------------------------------------------------------------------------------------------
# Ownership
# --------------------------------------------------------------------------------------------


def chunk_layer_range(
    dims: ModelDims, layout: ParallelLayout, pp_rank: int, vp_stage: int
) -> range:
    """Global layer indices of model chunk ``vp_stage`` on stage ``pp_rank``: Megatron's split,
    even or uneven (:func:`megarl.parallel.layout.chunk_layer_range`); raises ``ValueError``
    naming the problem where the split is not legal for this model."""
    problems = pipeline_split_problems(layout, dims.num_layers)
    if problems:
        raise ValueError(problems[0].describe(pp=f"PP={layout.pp}", vpp=f"VPP={layout.vpp}"))
    return layout_chunk_layer_range(layout, dims.num_layers, pp_rank, vp_stage)


def owner_of(mg_name: str, dims: ModelDims, layout: ParallelLayout) -> tuple[int, int]:
    """(pp_rank, vp_stage) holding the Megatron parameter ``mg_name`` (global index): its
    layer's chunk (:func:`megarl.parallel.layout.layer_chunk`); the embedding on (0, 0), the
    final norm and output layer on (P-1, V-1)."""
    layer = hm.layer_index(hm.from_te_name(mg_name))
    if layer is None:
        if hm.from_te_name(mg_name) == hm.EMBEDDING:
            return 0, 0
        return layout.pp - 1, layout.vpp - 1
    if not 0 <= layer < dims.num_layers:
        raise ValueError(f"{mg_name}: layer {layer} outside 0..{dims.num_layers - 1}")
    return layer_chunk(layout, dims.num_layers, layer)


# --------------------------------------------------------------------------------------------
# Shapes
# --------------------------------------------------------------------------------------------


def slot_pieces(
    slot: HFSlot, dims: ModelDims, rollout_tp: int, rank: int, rollout_ep: bool = False
) -> list[SlicePiece]:
    """What vLLM TP rank ``rank`` loads of ``slot``: one piece, or none when it loads nothing."""
    region = rollout_slice(slot.name, slot.shape, dims, rollout_tp, rank, rollout_ep)
    if region is None:
        return [SlicePiece(slot, None)]
    dim, start, stop = region
    if stop <= start:
        return []  # a vocabulary shard of vLLM's padding rows only, or another EP rank's expert
    if start == 0 and stop == slot.shape[dim]:
        return [SlicePiece(slot, None)]
    return [SlicePiece(slot, dim, start, stop)]


def check_rollout_tp(dims: ModelDims, rollout_tp: int, rollout_ep: bool = False) -> None:
    """vLLM's requirements on its TP size (and expert parallelism) for this model; raises
    ``ValueError`` naming them."""
    if rollout_tp < 1:
        raise ValueError(f"rollout TP must be >= 1, got {rollout_tp}")
    if dims.num_attention_heads % rollout_tp:
        raise ValueError(
            f"rollout TP={rollout_tp} does not divide num_attention_heads={dims.num_attention_heads}"
        )
    groups = dims.num_query_groups
    if groups % rollout_tp and rollout_tp % groups:
        raise ValueError(
            f"rollout TP={rollout_tp} must divide or be a multiple of num_key_value_heads={groups}"
        )
    if rollout_ep and not dims.num_experts:
        raise ValueError(
            f"vLLM expert parallelism (rollout_ep) needs a MoE model; {dims.architecture} is dense"
        )
    if rollout_ep and dims.num_experts < rollout_tp:
        raise ValueError(
            f"vLLM EP={rollout_tp} (its TP size) exceeds the model's {dims.num_experts} experts: "
            "some vLLM ranks would hold none"
        )


def require_training_layout(dims: ModelDims, layout: ParallelLayout) -> None:
    """Megatron's rule for this model (:func:`~megarl.parallel.layout.layout_problems`);
    raises ``ValueError`` naming the first problem."""
    tp, pp, vpp = layout.tp, layout.pp, layout.virtual_pipeline_model_parallel_size
    if tp < 1 or pp < 1 or (vpp is not None and vpp < 1):
        raise ValueError(f"invalid training layout {layout}")
    if layout.vpp > 1 and pp == 1:
        raise ValueError("virtual pipeline parallelism needs PP > 1")
    problems = shape_layout_problems(layout, dims.known())
    if problems:
        raise ValueError(
            problems[0].describe(tp=f"training TP={tp}", pp=f"PP={pp}", vpp=f"VPP={layout.vpp}")
        )
    if dims.padded_vocab_size % tp:
        raise ValueError(
            f"training TP={tp} does not divide padded_vocab_size={dims.padded_vocab_size} (the "
            "dimensions were read for another TP)"
        )
