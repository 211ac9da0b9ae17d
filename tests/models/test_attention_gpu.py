"""The local spec's core attention on CUDA runs real kernels (issue 54 item 6): PyTorch's flash
varlen kernel (bf16, packed rows) and SDPA (fp32, padded rows, CP chunks) match the float64
reference of ``test_attention_kernels.py``. The whole local-spec model on CUDA runs them in the
bare-node check's trainer runs (``tools/gpu_check.py --bare-node``). Skipped without CUDA
(conftest)."""

from __future__ import annotations

import pytest
import torch

from megarl.models.attention import kernel_attention
from tests.models.test_attention_kernels import HEADS, SCALE, _coords, _qkv, reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(("dtype", "cp", "atol"), [(torch.bfloat16, 1, 3e-2),
                                                   (torch.float32, 1, 1e-4),
                                                   (torch.float32, 2, 1e-4)])  # fmt: skip
def test_packed_kernels_match_the_reference_on_cuda(dtype, cp, atol):
    cu = torch.tensor([0, 64, 96, 256])
    q_all, k_all, v_all = _qkv(256, 256, seed=3)
    for rank in range(cp):
        c = _coords(cu, cp, rank)
        on = type(c)(*(t.cuda() for t in (c.q_seq, c.q_pos, c.k_seq, c.k_pos, c.cu_padded)),
                     c.longest)  # fmt: skip
        index, k_index = cu[c.q_seq] + c.q_pos, cu[c.k_seq] + c.k_pos
        q, k, v = (t.cuda().to(dtype) for t in (q_all[index], k_all[k_index], v_all[k_index]))
        out = kernel_attention(q, k, v, SCALE, coords=on, varlen=cp == 1).double().cpu()
        for seq in range(len(cu) - 1):
            lo, hi = int(cu[seq]), int(cu[seq + 1])
            pos = torch.arange(hi - lo)
            full = reference(q_all[lo:hi], k_all[lo:hi], v_all[lo:hi], pos[:, None] >= pos[None])
            mine = (c.q_seq == seq).nonzero().squeeze(1)
            assert (out[mine] - full[c.q_pos[mine]]).abs().max() < atol, (dtype, cp, seq)
    assert out.shape[1] == HEADS * q_all.shape[-1]
