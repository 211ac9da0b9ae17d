"""The local spec's attention on CUDA (``megarl.models.attention.kernel_attention``: PyTorch's
fused kernels, one call per layer) computes what the CPU emulation computes, against a plain
per-sequence softmax attention written here: right-padded rows with a padding mask, packed rows
(THD) with padded sequences, and a CP rank's chunks of each sequence attending to every rank's
keys. Grouped KV heads throughout (4 query heads, 2 groups). On CPU the same function runs
through ``scaled_dot_product_attention``'s CPU kernels; ``test_attention_gpu.py`` runs it on CUDA.
"""

from __future__ import annotations

import math

import pytest
import torch

from megarl.models.attention import RowCoordinates, kernel_attention
from megarl.models.packing import thd_coordinates

HEADS, GROUPS, DIM = 4, 2, 16
SCALE = 1 / math.sqrt(DIM)


def reference(q, k, v, allowed) -> torch.Tensor:
    """softmax(q·kᵀ·scale) v over the ``allowed`` keys, in float64, per head: q ``[Tq, H, D]``,
    k/v ``[Tk, G, D]``, allowed ``[Tq, Tk]`` -> ``[Tq, H·D]``."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * SCALE
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(q.shape[0], -1)


def _qkv(tq: int, tk: int, *lead: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tq, *lead, HEADS, DIM, generator=g)
    k = torch.randn(tk, *lead, GROUPS, DIM, generator=g)
    v = torch.randn(tk, *lead, GROUPS, DIM, generator=g)
    return q, k, v


def test_padded_rows_with_a_padding_mask():
    s, lengths = 7, [7, 4]
    q, k, v = _qkv(s, s, len(lengths))
    pos = torch.arange(s)
    real = torch.stack([pos < n for n in lengths])  # [b, s]
    masked = (pos[None, :, None] < pos[None, None, :]) | ~real[:, None, :]  # [b, q, k]
    out = kernel_attention(q, k, v, SCALE, mask=masked[:, None])
    assert out.shape == (s, len(lengths), HEADS * DIM)
    for b, n in enumerate(lengths):
        ref = reference(q[:n, b], k[:n, b], v[:n, b], ~masked[b, :n, :n])
        assert (out[:n, b].double() - ref).abs().max() < 1e-5
    causal = kernel_attention(q, k, v, SCALE)  # no mask: causal
    ref = reference(q[:, 0], k[:, 0], v[:, 0], pos[:, None] >= pos[None, :])
    assert (causal[:, 0].double() - ref).abs().max() < 1e-5


def _coords(cu: torch.Tensor, cp: int, rank: int) -> RowCoordinates:
    q_seq, q_pos = thd_coordinates(cu, cp, rank)
    keys = [thd_coordinates(cu, cp, r) for r in range(cp)]
    k_seq, k_pos = torch.cat([s for s, _ in keys]), torch.cat([p for _, p in keys])
    longest = int((cu[1:] - cu[:-1]).max())
    return RowCoordinates(q_seq, q_pos, k_seq, k_pos, cu.to(torch.int32), longest)


@pytest.mark.parametrize("cp", [1, 2])
def test_packed_rows_attend_within_each_sequence_across_cp_chunks(cp):
    """Three sequences padded to multiples of 2·CP, packed; each CP rank holds chunks r and
    2·CP−1−r of each. Every rank's output for its tokens equals full causal attention over
    the whole (unsplit) sequence at those positions."""
    cu = torch.tensor([0, 8, 12, 24])
    total = int(cu[-1])
    q_all, k_all, v_all = _qkv(total, total, seed=cp)
    for rank in range(cp):
        c = _coords(cu, cp, rank)
        # this rank's tokens of the row, and every rank's keys in all-gather order
        index = cu[c.q_seq] + c.q_pos
        k_index = cu[c.k_seq] + c.k_pos
        out = kernel_attention(q_all[index], k_all[k_index], v_all[k_index], SCALE, coords=c)
        assert out.shape == (len(index), HEADS * DIM)
        for seq in range(len(cu) - 1):
            lo, hi = int(cu[seq]), int(cu[seq + 1])
            pos = torch.arange(hi - lo)
            full = reference(q_all[lo:hi], k_all[lo:hi], v_all[lo:hi], pos[:, None] >= pos[None])
            mine = (c.q_seq == seq).nonzero().squeeze(1)
            expected = full[c.q_pos[mine]]
            assert (out[mine].double() - expected).abs().max() < 1e-5, (cp, rank, seq)


@pytest.mark.parametrize("cp", [1, 2])
@pytest.mark.parametrize(
    ("lengths", "group_sizes"),
    [([8, 4, 8, 4, 4, 8], [6]), ([4] * 10 + [32, 28], [2, 10]), ([8, 8, 8], [3])],
)
def test_length_groups_batch_sequences_with_their_own_keys_and_mask(cp, lengths, group_sizes):
    """The CPU emulation's batching (:func:`megarl.models.attention.length_groups`): sequences
    of similar padded lengths form one group (a few short ones beside a long one do not); each
    member's queries, keys and causal mask are the ones it has alone, its padded key columns
    masked, and the index reads the groups' outputs back in the row's order."""
    from types import SimpleNamespace

    from megarl.models.attention import length_groups

    cu = torch.tensor([0, *lengths]).cumsum(0)
    for rank in range(cp):
        params = SimpleNamespace(cu_seqlens_q_padded=cu, cu_seqlens_q=cu)
        groups, back = length_groups(params, cp, rank, torch.device("cpu"))
        c = _coords(cu, cp, rank)
        assert sorted(g.n for g in groups) == group_sizes
        seen = []
        for g in groups:
            qs, ks = g.queries.view(-1, g.n), g.keys.view(-1, g.n)
            for j in range(g.n):
                seq = int(c.q_seq[qs[0, j]])
                seen.append(seq)
                own_q = (c.q_seq == seq).nonzero().squeeze(1)
                own_k = (c.k_seq == seq).nonzero().squeeze(1)
                assert torch.equal(qs[: len(own_q), j], own_q)
                assert torch.equal(ks[: len(own_k), j], own_k)
                alone = c.k_pos[own_k][None, :] > c.q_pos[own_q][:, None]
                mask = g.mask[j if g.mask.shape[0] > 1 else 0, 0, : len(own_q)]
                assert torch.equal(mask[:, : len(own_k)], alone)
                assert bool(mask[:, len(own_k) :].all())  # a padded column is never seen
        assert sorted(seen) == list(range(len(lengths)))
        tokens = torch.cat([g.queries for g in groups])
        assert torch.equal(tokens.index_select(0, back), torch.arange(len(c.q_seq)))
