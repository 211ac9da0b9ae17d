"""Core attention of the local (CPU) layer spec for packed sequences and context parallelism.

Megatron-Core's local ``DotProductAttention`` refuses packed (THD) sequences and context
parallelism; both are Transformer Engine's on GPU (``TEDotProductAttention``). This subclass
is the emulation the local spec uses instead, selected with it (:func:`megarl.models.gpt.
layer_spec`): right-padded micro-batches go through Megatron's own code unchanged; a packed row
attends causally within each sequence (block-diagonal causal), and under context parallelism
each rank's queries attend to the keys and values of every CP rank (all-gathered, differentiable:
the gradients of the others' keys and values go back to them) with the chunk-aware causal mask
of :func:`megarl.models.packing.thd_coordinates`. Exact; each sequence's scores are computed
alone (``[heads, its queries, its keys]``), so packing saves the padding's compute here too.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
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


def sequence_blocks(params, cp_size: int, cp_rank: int):
    """Per packed sequence (under ``params``): the indices of its queries among this rank's
    tokens, of its keys among every CP rank's tokens (rank order, as the CP all-gather returns
    them), and its causal mask ``[1, 1, queries, keys]`` (True: masked; a query sees the keys
    of its sequence at its position or before)."""
    cu = (
        params.cu_seqlens_q_padded
        if params.cu_seqlens_q_padded is not None
        else params.cu_seqlens_q
    )
    cu = cu.cpu()
    q_seq, q_pos = thd_coordinates(cu, cp_size, cp_rank)
    keys = [thd_coordinates(cu, cp_size, r) for r in range(cp_size)]
    k_seq = torch.cat([seq for seq, _ in keys])
    k_pos = torch.cat([pos for _, pos in keys])
    for seq in range(len(cu) - 1):
        queries = (q_seq == seq).nonzero().squeeze(1)
        if queries.numel() == 0:
            continue
        keys_of = (k_seq == seq).nonzero().squeeze(1)
        masked = k_pos[keys_of][None, :] > q_pos[queries][:, None]
        yield queries, keys_of, masked[None, None]


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
        if packed_seq_params is None:
            if self.cp_size > 1:
                raise ValueError("context parallelism needs packed sequences (use_remove_padding)")
            return super().forward(
                query, key, value, attention_mask, attn_mask_type, attention_bias, None
            )
        # THD: [tokens, heads, dim] -> Megatron's [s, b=1, heads, dim]
        query, key, value = (t.unsqueeze(1) for t in (query, key, value))
        cp_rank = parallel_state.get_context_parallel_rank() if self.cp_size > 1 else 0
        if self.cp_size > 1:
            key = _GatherOverContextParallel.apply(key)
            value = _GatherOverContextParallel.apply(value)
        # One sequence at a time: the cost is the sum of the squared lengths, not the square of
        # the row's length.
        outputs, order = [], []
        for queries, keys_of, mask in sequence_blocks(packed_seq_params, self.cp_size, cp_rank):
            on = query.device
            q = query.index_select(0, queries.to(on))
            k, v = (t.index_select(0, keys_of.to(on)) for t in (key, value))
            outputs.append(super().forward(q, k, v, mask.to(on), attn_mask_type, attention_bias))
            order.append(queries)
        back = torch.argsort(torch.cat(order)).to(query.device)  # to the row's token order
        return torch.cat(outputs).index_select(0, back).squeeze(1)  # [tokens, heads·dim]
