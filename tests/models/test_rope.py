"""megarl's THD rotary embedding (megarl.models.rope) is Megatron's, bit for bit, kept per row."""

from __future__ import annotations

import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils

from megarl.models import rope


class _Group:
    """What the THD rotary embedding reads of a CP group: its size and this rank."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _row(cp: int, per_token: bool, dim: int = 32):
    lengths = [12, 10, 16, 8, 14] if cp == 1 else [8 * cp, 4 * cp, 12 * cp]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    freqs = torch.randn(int(cu[-1]) if per_token else 64, 1, 1, dim)
    return cu, freqs, int(cu[-1]) // cp


@pytest.mark.parametrize(
    "cp,rank,per_token,interleaved,mscale,dtype",
    [
        (1, 0, False, False, 1.0, torch.float32),
        (1, 0, True, False, 1.0, torch.float32),
        (2, 0, False, False, 1.0, torch.float32),
        (2, 1, False, True, 1.0, torch.float32),
        (4, 3, True, False, 0.7, torch.float32),
        (1, 0, False, False, 1.3, torch.bfloat16),
    ],
)
def test_thd_rotation_and_gradient_are_megatrons_bit_for_bit(
    cp, rank, per_token, interleaved, mscale, dtype
):
    torch.manual_seed(cp * 10 + rank)
    cu, freqs, tokens = _row(cp, per_token)
    x = torch.randn(tokens, 3, 40, dtype=dtype)  # 40 > 32: a part left unrotated
    group = _Group(cp, rank)
    grad = torch.randn(tokens, 3, 40, dtype=dtype)
    results = []
    for fn in (rope._megatron_thd, rope.apply_thd, rope.apply_thd):  # the second call: cached
        leaf = x.clone().requires_grad_()
        out = fn(leaf, cu, freqs, interleaved, False, mscale, group)
        out.backward(grad)
        results.append((out.detach(), leaf.grad))
    for out, g in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(g, results[0][1])
    assert cu._megarl_rope[0] is freqs


def test_the_kept_frequencies_follow_a_new_row_and_new_frequencies():
    torch.manual_seed(0)
    group = _Group(1, 0)
    cu, freqs, tokens = _row(1, False)
    x = torch.randn(tokens, 2, 32)
    rope.apply_thd(x, cu, freqs, cp_group=group)
    other = freqs * 2.0  # another frequency tensor for the same row
    assert torch.equal(
        rope.apply_thd(x, cu, other, cp_group=group),
        rope._megatron_thd(x, cu, other, cp_group=group),
    )
    freqs.mul_(3.0)  # changed in place: its version moves
    assert torch.equal(
        rope.apply_thd(x, cu, freqs, cp_group=group),
        rope._megatron_thd(x, cu, freqs, cp_group=group),
    )
    cu[1:] = torch.tensor([10, 30, 40, 50, 60], dtype=torch.int32)  # the row itself, in place
    assert torch.equal(
        rope.apply_thd(x, cu, freqs, cp_group=group),
        rope._megatron_thd(x, cu, freqs, cp_group=group),
    )


def test_megatrons_rotary_entry_point_takes_it_once_installed():
    """The path Megatron's attention calls (``apply_rotary_pos_emb`` with ``cu_seqlens``) goes
    through megarl's rotation once a model is built (``build_gpt_chunks`` installs it)."""
    rope.install()
    assert rope_utils._apply_rotary_pos_emb_thd is rope.apply_thd

    class Config:
        apply_rope_fusion = False
        rotary_interleaved = False
        multi_latent_attention = False

    cu, freqs, tokens = _row(1, False)
    x = torch.randn(tokens, 2, 32)
    out = rope_utils.apply_rotary_pos_emb(x, freqs, Config(), cu_seqlens=cu, cp_group=_Group(1, 0))
    assert hasattr(cu, "_megarl_rope")
    assert torch.equal(out, rope._megatron_thd(x, cu, freqs, cp_group=_Group(1, 0)))
