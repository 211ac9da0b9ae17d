"""The adapter hook against the output forms of Megatron's linears (CPU, no process group).

Transformer Engine does not run here (its spec is checked on a GPU: ``test_te_gpu.py``), so the
hook's reading of Megatron's ``TELayerNormColumnParallelLinear`` output once TE's
``return_layernorm_output`` is set is checked on tensors of that documented form: the adapter
takes the returned norm output, the caller gets ``(output, bias)`` back.
"""

from __future__ import annotations

import types

import torch

from megarl.models.lora import LoraAdapter, LoraSettings, _add_adapter_output

SETTINGS = LoraSettings(rank=2, alpha=4.0)


def _linear_with_adapter():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 6, generator=g), torch.randn(5, 2, generator=g)
    return types.SimpleNamespace(lora=LoraAdapter("column", a, b, SETTINGS, tp_size=1)), a, b


def test_the_adapter_takes_the_norm_output_te_returns():
    module, a, b = _linear_with_adapter()
    g = torch.Generator().manual_seed(1)
    block_input, ln_out, out = (torch.randn(3, 6, generator=g), torch.randn(3, 6, generator=g),
                                torch.randn(3, 5, generator=g))  # fmt: skip
    bias = torch.randn(5, generator=g)
    want = out + 2.0 * ln_out @ a.T @ b.T
    for output, want_bias in ((((out, ln_out), None), None), ((out, bias, ln_out), bias)):
        got, got_bias = _add_adapter_output(module, (block_input,), output, norm_fused=True)
        assert torch.allclose(got, want, atol=1e-6) and got_bias is want_bias
        module.lora.enabled = False  # adapters off: the linear's own output, still a pair
        got, got_bias = _add_adapter_output(module, (block_input,), output, norm_fused=True)
        assert got is out and got_bias is want_bias
        module.lora.enabled = True


def test_unfused_linears_adapt_their_input():
    module, a, b = _linear_with_adapter()
    x, out = torch.randn(3, 6), torch.randn(3, 5)
    got, bias = _add_adapter_output(module, (x,), (out, None))
    assert torch.allclose(got, out + 2.0 * x @ a.T @ b.T, atol=1e-6) and bias is None
