"""Core attention of the local (CPU) layer spec for packed sequences and context parallelism.

Megatron-Core's local ``DotProductAttention`` refuses packed (THD) sequences and context
parallelism; both are Transformer Engine's on GPU (``TEDotProductAttention``). This subclass
is the emulation the local spec uses instead, selected with it (:func:`megarl.models.gpt.
layer_spec`): right-padded micro-batches go through Megatron's own code unchanged; a packed row
attends causally within each sequence (block-diagonal causal), and under context parallelism
each rank's queries attend to the keys and values of every CP rank (all-gathered, differentiable:
the gradients of the others' keys and values go back to them) with the chunk-aware causal mask
of :func:`megarl.models.packing.thd_coordinates`. Exact; each sequence's scores are computed
with its own keys only (a neighbour's and padded columns masked), sequences of similar padded
lengths batched in one call (:func:`length_groups`), so packing saves most of the padding's
compute here too.

On CUDA (the local spec there: MoE LoRA, ``transformer_impl=local``) the same class runs real
attention kernels instead (:func:`kernel_attention`): PyTorch's flash varlen kernel for packed
rows in 16 bits at CP 1, else ``scaled_dot_product_attention`` (flash, cuDNN or memory-efficient)
with the same causal, per-sequence and CP-chunk-aware mask, built once per forward on the device
(no loop over sequences, no host sync per layer). The emulation stays the CPU path; both compute
the same function (``tests/models/test_attention_kernels.py``).
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer.dot_product_attention import DotProductAttention

from megarl.models.packing import thd_coordinates


class _GatherOverContextParallel(torch.autograd.Function):
    """All-gather along dim 0 over the CP group; backward: the gradients summed over the group,
    this rank's slice kept (gloo has no reduce-scatter, so an all-reduce and a slice)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor) -> torch.Tensor:
        group = parallel_state.get_context_parallel_group()
        ctx.rank, ctx.size, ctx.n = dist.get_rank(group), dist.get_world_size(group), local.shape[0]
        parts = [torch.empty_like(local) for _ in range(ctx.size)]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=parallel_state.get_context_parallel_group())
        return grad[ctx.rank * ctx.n : (ctx.rank + 1) * ctx.n]


def _row_coordinates(params, cp_size: int, cp_rank: int):
    """The packed row's padded sequence starts (on the host), this rank's queries' sequence and
    position, and every CP rank's keys' (in the order the CP all-gather returns them)
    (:func:`megarl.models.packing.thd_coordinates`)."""
    cu = params.cu_seqlens_q_padded
    cu = (params.cu_seqlens_q if cu is None else cu).cpu()
    q_seq, q_pos = thd_coordinates(cu, cp_size, cp_rank)
    keys = [thd_coordinates(cu, cp_size, r) for r in range(cp_size)]
    k_seq, k_pos = torch.cat([k for k, _ in keys]), torch.cat([p for _, p in keys])
    return cu, q_seq, q_pos, k_seq, k_pos


@dataclass(frozen=True)
class LengthGroup:
    """Packed sequences of similar padded lengths, attended together as one batch, each padded
    to the group's longest: ``queries`` ``[Lq·n]`` (their queries among this rank's tokens,
    position-major: index ``i·n + j`` is query ``i`` of sequence ``j``, Megatron's ``[s, b]``
    order; a shorter sequence's rows past its end repeat one of its tokens and are dropped),
    ``keys`` ``[Lk·n]`` (their keys among every CP rank's tokens, in the order the CP all-gather
    returns them, the same way; a shorter sequence's columns past its end are masked), ``n`` and
    the mask (True: masked), ``[1, 1, Lq, Lk]`` when every member has the group's length, else
    ``[n, 1, Lq, Lk]``."""

    queries: torch.Tensor
    keys: torch.Tensor
    n: int
    mask: torch.Tensor


GROUP_SLACK = 2.0
"""A group's padded attention cost (members × its longest length²) may be at most this many times
its members' own (the sum of their squared lengths): on the CPU each group is a dozen calls per
layer, forward and backward, which cost far more than a few padded scores at the lengths it runs."""


def _similar_lengths(sizes: dict[int, int]) -> list[list[int]]:
    """The padded lengths of ``sizes`` (length -> sequences of it) in groups of neighbours,
    shortest first, each within :data:`GROUP_SLACK` of its members' own attention cost."""
    groups: list[list[int]] = []
    own = count = 0
    for length in sorted(sizes):
        n = sizes[length]
        if groups and (count + n) * length**2 <= GROUP_SLACK * (own + n * length**2):
            groups[-1].append(length)
            own, count = own + n * length**2, count + n
        else:
            groups.append([length])
            own, count = n * length**2, n
    return groups


def length_groups(
    params, cp_size: int, cp_rank: int, device
) -> tuple[list[LengthGroup], torch.Tensor]:
    """The packed row of ``params`` as :class:`LengthGroup` s, and the index that reads every
    token's output, in the row's order, from their outputs concatenated (each ``[Lq·n]``).
    A query sees the keys of its own sequence at its position or before (under CP the chunk
    positions depend only on the padded length), never a neighbour's or a padded column, so
    each group is one batched call that computes what each member alone would. Computed once
    per forward (one host read of the sequence starts) and kept on ``params``, the object every
    layer of the forward receives."""
    key = ("groups", cp_size, cp_rank, str(device))
    cached = getattr(params, "_megarl_groups", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    cu, q_seq, q_pos, k_seq, k_pos = _row_coordinates(params, cp_size, cp_rank)
    q_order, k_order = torch.argsort(q_seq, stable=True), torch.argsort(k_seq, stable=True)
    q_count = torch.bincount(q_seq, minlength=len(cu) - 1).tolist()
    k_count = torch.bincount(k_seq, minlength=len(cu) - 1).tolist()
    q_starts = [0, *torch.tensor(q_count).cumsum(0).tolist()]
    k_starts = [0, *torch.tensor(k_count).cumsum(0).tolist()]
    by_length: dict[int, list[int]] = {}
    for seq, size in enumerate((cu[1:] - cu[:-1]).tolist()):
        if q_count[seq]:
            by_length.setdefault(size, []).append(seq)
    groups, order = [], []
    for lengths in _similar_lengths({size: len(seqs) for size, seqs in by_length.items()}):
        members = [seq for size in lengths for seq in by_length[size]]
        lq, lk = max(q_count[m] for m in members), max(k_count[m] for m in members)
        qs = torch.full((lq, len(members)), -1, dtype=torch.long)
        ks = torch.full((lk, len(members)), -1, dtype=torch.long)
        for j, m in enumerate(members):
            qs[: q_count[m], j] = q_order[q_starts[m] : q_starts[m + 1]]
            ks[: k_count[m], j] = k_order[k_starts[m] : k_starts[m + 1]]
        order.append(qs.reshape(-1))
        # rows past a sequence's end repeat its first query (dropped); columns past it, masked
        first_q, first_k = qs[0].expand_as(qs), ks[0].expand_as(ks)
        qs, kept = torch.where(qs >= 0, qs, first_q), ks >= 0
        ks = torch.where(kept, ks, first_k)
        masked = (k_pos[ks].T[:, None, :] > q_pos[qs].T[:, :, None]) | ~kept.T[:, None, :]
        if len(lengths) == 1:  # one length: one causal mask for all
            masked = masked[:1]
        groups.append(
            LengthGroup(qs.reshape(-1).to(device), ks.reshape(-1).to(device), len(members),
                        masked[:, None].to(device))
        )  # fmt: skip
    flat = torch.cat(order)
    real = (flat >= 0).nonzero().squeeze(1)
    back = torch.empty(len(q_seq), dtype=torch.long)
    back[flat[real]] = real
    back = back.to(device)
    params._megarl_groups = (key, (groups, back))
    return groups, back


class PackedDotProductAttention(DotProductAttention):
    """Megatron's local core attention, plus packed rows (THD) and context parallelism."""

    def __init__(self, config, *args, **kwargs) -> None:
        # The parent refuses CP > 1 (only TE's attention exchanges keys across CP ranks); this
        # class does that exchange itself, so the parent is built as for CP = 1.
        self.cp_size = config.context_parallel_size
        if self.cp_size > 1:
            config = copy.copy(config)
            config.context_parallel_size = 1
        super().__init__(config, *args, **kwargs)

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        if packed_seq_params is None and self.cp_size > 1:
            raise ValueError("context parallelism needs packed sequences (use_remove_padding)")
        if query.is_cuda and self.kernels_apply():
            return self.kernel_forward(query, key, value, attention_mask, packed_seq_params)
        if packed_seq_params is None:
            return super().forward(
                query, key, value, attention_mask, attn_mask_type, attention_bias, None
            )
        # THD: [tokens, heads, dim] -> Megatron's [s, b=1, heads, dim]
        query, key, value = (t.unsqueeze(1) for t in (query, key, value))
        cp_rank = parallel_state.get_context_parallel_rank() if self.cp_size > 1 else 0
        if self.cp_size > 1:
            key = _GatherOverContextParallel.apply(key)
            value = _GatherOverContextParallel.apply(value)
        # The sequences of each padded length together, as one batch: the cost is the sum of
        # the squared lengths, not the square of the row's length, in one call per length.
        groups, back = length_groups(packed_seq_params, self.cp_size, cp_rank, query.device)
        outputs = []
        for g in groups:
            q = query.index_select(0, g.queries).view(-1, g.n, *query.shape[2:])
            k, v = (t.index_select(0, g.keys).view(-1, g.n, *t.shape[2:]) for t in (key, value))
            out = super().forward(q, k, v, g.mask, attn_mask_type, attention_bias)
            outputs.append(out.reshape(q.shape[0] * g.n, -1))
        return torch.cat(outputs).index_select(0, back)  # [tokens, heads·dim], the row's order

    def kernels_apply(self) -> bool:
        """Whether :func:`kernel_attention` computes what Megatron's local attention would:
        no softmax offset, no sliding window, no attention dropout while training."""
        window = getattr(self.scale_mask_softmax, "window_size", None)
        dropout = self.training and self.attention_dropout.p > 0
        return self.softmax_offset is None and window is None and not dropout

    def kernel_forward(self, query, key, value, attention_mask, packed_seq_params):
        """:func:`kernel_attention` with this layer's scale (and, under CP, every CP rank's keys
        and values, all-gathered as the emulation does). Output ``[s, b, heads·dim]`` (padded
        rows) or ``[tokens, heads·dim]`` (THD)."""
        if packed_seq_params is None:
            return kernel_attention(query, key, value, self.softmax_scale, mask=attention_mask)
        cp_rank = parallel_state.get_context_parallel_rank() if self.cp_size > 1 else 0
        if self.cp_size > 1:
            key = _GatherOverContextParallel.apply(key)
            value = _GatherOverContextParallel.apply(value)
        coords = thd_device_coordinates(packed_seq_params, self.cp_size, cp_rank, query.device)
        return kernel_attention(query, key, value, self.softmax_scale, coords=coords,
                                varlen=self.cp_size == 1)  # fmt: skip


MASKED_SCORE = -10000.0
"""The score a masked position gets (Megatron's ``attention_mask_func``): a query that sees no
key gets a uniform average, as in Megatron's local attention, never NaN."""


@dataclass(frozen=True)
class RowCoordinates:
    """Where each token of a packed row sits, on the device: this rank's queries' and every CP
    rank's keys' (in the order the CP all-gather returns them) sequence and position
    (:func:`megarl.models.packing.thd_coordinates`), the padded sequence starts (int32) and the
    longest padded sequence."""

    q_seq: torch.Tensor
    q_pos: torch.Tensor
    k_seq: torch.Tensor
    k_pos: torch.Tensor
    cu_padded: torch.Tensor
    longest: int


def thd_device_coordinates(params, cp_size: int, cp_rank: int, device) -> RowCoordinates:
    """The :class:`RowCoordinates` of the packed row of ``params``, computed once per forward
    (one host read of the sequence starts): kept on ``params``, the object every layer of the
    forward receives."""
    key = (cp_size, cp_rank, str(device))
    cached = getattr(params, "_megarl_coordinates", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    cu, q_seq, q_pos, k_seq, k_pos = _row_coordinates(params, cp_size, cp_rank)
    on = [t.to(device, non_blocking=True) for t in (q_seq, q_pos, k_seq, k_pos)]
    longest = int((cu[1:] - cu[:-1]).max()) if len(cu) > 1 else 0
    coords = RowCoordinates(*on, cu.to(device, torch.int32), longest)
    params._megarl_coordinates = (key, coords)
    return coords


def kernel_attention(query, key, value, scale: float, *, mask=None, coords=None, varlen=False):
    """Causal attention through PyTorch's fused kernels, with grouped KV heads.

    Padded rows: ``query [s, b, heads, dim]``, ``key``/``value [s, b, groups, dim]``, ``mask``
    Megatron's boolean ``[b or 1, 1, s, s]`` (True: masked; None: causal) -> ``[s, b, heads·dim]``.
    Packed rows (THD): ``query [Tq, heads, dim]``, ``key``/``value [Tk, groups, dim]``,
    ``coords`` (:class:`RowCoordinates`: a query sees the keys of its own sequence at its
    position or before) -> ``[Tq, heads·dim]``; ``varlen`` (CP 1 only) allows the flash varlen
    kernel, used on CUDA in 16 bits when PyTorch has it.
    """
    heads, groups = query.shape[-2], key.shape[-2]
    if coords is None:
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
        k, v = _expand_groups(k, v, heads // groups, dim=1)
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:
            bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device)
            bias.masked_fill_(mask.to(q.device), MASKED_SCORE)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)
    kernel = _varlen_kernel() if varlen and query.is_cuda else None
    if kernel is not None and query.dtype in (torch.bfloat16, torch.float16):
        return _varlen(kernel, query, key, value, scale, coords).reshape(query.shape[0], -1)
    c = coords
    sees = (c.q_seq[:, None] == c.k_seq[None, :]) & (c.k_pos[None, :] <= c.q_pos[:, None])
    bias = torch.zeros(sees.shape, dtype=query.dtype, device=query.device)
    bias.masked_fill_(~sees, MASKED_SCORE)
    q, k, v = (t.transpose(0, 1)[None] for t in (query, key, value))  # [1, h, T, d]
    k, v = _expand_groups(k, v, heads // groups, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias[None, None], scale=scale)
    return out[0].transpose(0, 1).reshape(query.shape[0], -1)


def _expand_groups(k, v, repeat: int, dim: int):
    if repeat == 1:
        return k, v
    return k.repeat_interleave(repeat, dim=dim), v.repeat_interleave(repeat, dim=dim)


def _varlen_kernel():
    """PyTorch's flash varlen attention (``torch.nn.attention.varlen.varlen_attn``), None where
    this PyTorch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _varlen(varlen_attn, query, key, value, scale: float, coords: RowCoordinates):
    """One flash varlen call over the packed row's padded sequences (causal within each). Its
    keyword for causality changed across PyTorch releases (``is_causal`` in 2.9, a
    ``window_size`` of (-1, 0) later); grouped KV heads are expanded where it takes no
    ``enable_gqa``."""
    params = inspect.signature(varlen_attn).parameters
    cu, longest = coords.cu_padded, coords.longest
    kwargs = {"scale": scale}
    kwargs.update({"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True})
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    else:
        key, value = _expand_groups(key, value, query.shape[-2] // key.shape[-2], dim=1)
    return varlen_attn(query, key, value, cu, cu, longest, longest, **kwargs)
