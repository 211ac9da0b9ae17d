"""Sequences packed into one row without padding (THD), and their split over context parallelism.

A micro-batch of ``b`` right-padded sequences ``[b, S]`` becomes one row of ``T`` tokens: each
sequence ``i`` of ``L_i`` tokens padded only to ``P_i``, the next multiple of what Megatron needs
(``2·CP``, times TP under sequence parallelism), sequences back to back. Megatron gets the
boundaries as a :class:`~megatron.core.packed_seq_params.PackedSeqParams` (THD: cumulative
lengths, real and padded, and the longest padded length); RoPE restarts at every sequence.

Under context parallelism each padded sequence is cut into ``2·CP`` equal chunks and CP rank
``r`` holds chunks ``r`` and ``2·CP−1−r`` (Megatron's and Transformer Engine's load-balanced
layout, the one Megatron's THD RoPE assumes), the sequences' pieces back to back.

Every token the model sees is located by its index in the micro-batch's ``[b, width]`` grid
(``row·width + position``, -1 for padding): :class:`TokenOrder`. The same order describes the
right-padded layout (sequence-major, as Megatron's ``[s, b]`` activations), so routing replay and
the outputs map back to per-sequence tensors one way for both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams


@dataclass
class TokenOrder:
    """Where each token the model sees sits in the micro-batch's ``[rows, width]`` grid."""

    grid: torch.Tensor
    """``[CP, n]`` long: CP rank ``r``'s ``n`` tokens in the model's order, each as
    ``row·width + position``; -1 for padding (no sequence's token)."""
    rows: int
    """Sequences of the micro-batch."""
    width: int
    """Grid positions per sequence."""

    @property
    def local(self) -> torch.Tensor:
        """``[n]``: this CP rank's tokens (:func:`cp_rank_and_size`)."""
        return self.grid[cp_rank_and_size()[0]] if self.grid.shape[0] > 1 else self.grid[0]

    @classmethod
    def padded(cls, rows: int, seq: int, device=None) -> TokenOrder:
        """The right-padded layout ``[b, seq]`` seen sequence-major (Megatron's ``[s, b]``)."""
        grid = (
            torch.arange(rows, device=device)[None, :] * seq
            + torch.arange(seq, device=device)[:, None]
        )
        return cls(grid.reshape(1, -1), rows, seq)

    def to_grid(self, values: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """``[rows, width, ...]`` from per-token ``values`` ``[CP, n, ...]`` (every rank's, in
        :attr:`grid`'s order); padding dropped, positions no token holds ``fill``."""
        flat_index = self.grid.reshape(-1)
        flat = values.reshape(flat_index.shape[0], *values.shape[2:])
        keep = flat_index >= 0
        out = flat.new_full((self.rows * self.width, *values.shape[2:]), fill)
        out = out.index_put((flat_index[keep],), flat[keep])
        return out.view(self.rows, self.width, *values.shape[2:])

    def from_grid(self, grid_values: torch.Tensor, fill) -> torch.Tensor:
        """This CP rank's tokens ``[n, ...]`` read from ``grid_values`` ``[rows, width, ...]``;
        padding gets ``fill``."""
        local = self.local
        flat = grid_values.reshape(self.rows * self.width, *grid_values.shape[2:])
        picked = flat[local.clamp(min=0)]
        pad = (local < 0).view(-1, *([1] * (picked.dim() - 1)))
        return torch.where(
            pad, torch.as_tensor(fill, dtype=picked.dtype, device=picked.device), picked
        )


@dataclass
class PackedRows:
    """One micro-batch packed for this CP rank: what the model is called with."""

    input_ids: torch.Tensor
    """``[1, n]`` this CP rank's tokens (padding: token 0)."""
    position_ids: torch.Tensor
    """``[1, n]`` each token's position within its sequence."""
    params: PackedSeqParams
    """The sequence boundaries of the whole packed row (before the CP split), THD."""
    order: TokenOrder
    """Where every CP rank's tokens sit in the ``[b, S]`` grid."""

    @property
    def padding(self) -> torch.Tensor:
        """``[1, n]`` True at this rank's padding tokens (the MoE routers' padding mask)."""
        return (self.order.local < 0)[None]

    @property
    def length(self) -> int:
        """Tokens of the whole packed row, over every CP rank."""
        return int(self.order.grid.numel())


def cp_rank_and_size() -> tuple[int, int]:
    """This rank's context-parallel rank and the CP size (0, 1 without Megatron's state)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    return (
        parallel_state.get_context_parallel_rank(),
        parallel_state.get_context_parallel_world_size(),
    )


def padded_lengths(lengths: list[int], multiple: int) -> list[int]:
    """Each length rounded up to ``multiple`` (a sequence of 0 tokens stays 0)."""
    return [-(-n // multiple) * multiple for n in lengths]


def thd_coordinates(
    cu_padded: torch.Tensor, cp_size: int, cp_rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sequence, position)`` of each token CP rank ``cp_rank`` holds of a packed row whose
    padded sequences start at ``cu_padded`` (``[k + 1]``): chunks ``r`` and ``2·CP−1−r`` of each
    sequence, sequences in order (the layout :func:`pack_rows` builds)."""
    sizes = (cu_padded[1:] - cu_padded[:-1]).tolist()
    seqs, positions = [], []
    for seq, size in enumerate(sizes):
        if cp_size == 1:
            pos = torch.arange(size)
        else:
            chunk = size // (2 * cp_size)
            first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
            second_start = (2 * cp_size - 1 - cp_rank) * chunk
            pos = torch.cat([first, torch.arange(second_start, second_start + chunk)])
        positions.append(pos)
        seqs.append(torch.full_like(pos, seq))
    device = cu_padded.device
    return torch.cat(seqs).to(device), torch.cat(positions).to(device)


def pack_rows(
    input_ids: torch.Tensor,
    lengths: torch.Tensor,
    *,
    multiple: int,
    total: int | None = None,
) -> PackedRows:
    """Pack right-padded ``input_ids`` ``[b, S]`` of real ``lengths`` into one THD row, each
    sequence padded to ``multiple`` (a multiple of ``2·CP`` under context parallelism), and cut
    it for this CP rank. ``total``: pad the row to that many tokens with one more (padding)
    sequence (pipelines that need one length for every micro-batch)."""
    cp_rank, cp_size = cp_rank_and_size()
    if cp_size > 1 and multiple % (2 * cp_size):
        raise ValueError(f"packing multiple {multiple} is not a multiple of 2·CP = {2 * cp_size}")
    rows, width = input_ids.shape
    real = [int(n) for n in lengths.tolist()]
    padded = padded_lengths(real, multiple)
    if total is not None and total > sum(padded):
        if (total - sum(padded)) % multiple:
            raise ValueError(f"packed length {total} is not a multiple of {multiple}")
        padded.append(total - sum(padded))
        real.append(padded[-1])  # the filler's tokens count as its own (discarded) sequence
    device = input_ids.device
    cu_padded = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()], dtype=torch.int32)
    cu_real = torch.tensor([0, *torch.tensor(real).cumsum(0).tolist()], dtype=torch.int32)
    grids = []
    for r in range(cp_size):
        seq, pos = thd_coordinates(cu_padded, cp_size, r)
        in_batch = seq < rows
        length = torch.tensor(real)[seq]
        keep = in_batch & (pos < length)
        grids.append(torch.where(keep, seq * width + pos, -1))
    order = TokenOrder(torch.stack(grids).to(device), rows, width)
    local = order.local
    ids = torch.where(local >= 0, input_ids.reshape(-1)[local.clamp(min=0)], 0)
    _, pos = thd_coordinates(cu_padded, cp_size, cp_rank)
    longest = max(padded) if padded else 0
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_real.to(device),
        cu_seqlens_kv=cu_real.to(device),
        cu_seqlens_q_padded=cu_padded.to(device),
        cu_seqlens_kv_padded=cu_padded.to(device),
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )
    return PackedRows(ids[None], pos.to(device)[None], params, order)


def gather_over_cp(local: torch.Tensor) -> torch.Tensor:
    """``[CP, ...]``: every CP rank's ``local`` (equal shapes), this rank's own entry the live
    tensor (gradients flow into it; the others' are detached: each rank's loss reaches its own
    tokens, and the gradients meet in the data×context-parallel reduction)."""
    cp_rank, cp_size = cp_rank_and_size()
    if cp_size == 1:
        return local[None]
    from megatron.core import parallel_state

    parts = [torch.empty_like(local) for _ in range(cp_size)]
    dist.all_gather(
        parts, local.detach().contiguous(), group=parallel_state.get_context_parallel_group()
    )
    parts[cp_rank] = local
    return torch.stack(parts)
