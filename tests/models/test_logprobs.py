"""vocab_parallel_log_probs_and_entropy at TP=1 against log_softmax in float64: values and
gradients, padded columns ignored (TP=2: ``test_parallel_models.py``'s vocab-parallel check)."""

from __future__ import annotations

import pytest
import torch

from megarl.models.logprobs import vocab_parallel_log_probs_and_entropy


def _reference(logits: torch.Tensor, targets, vocab: int, temperature: float, w_lp, w_ent):
    full = logits.detach().double().requires_grad_(True)
    logp = torch.log_softmax(full[..., :vocab] / temperature, dim=-1)
    lp = logp.gather(-1, targets[..., None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    return lp, ent, full.grad


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [3, 1024])
def test_values_and_gradients_match_log_softmax(temperature, chunk):
    g = torch.Generator().manual_seed(0)
    vocab, padded = 50, 64
    logits = 3 * torch.randn(3, 7, padded, generator=g)
    logits[..., vocab:] = 1e4  # padding: would dominate if it were read
    logits[0, 0, 3] = 60.0  # a near one-hot position (entropy ~ 0, p ~ 0 elsewhere)
    targets = torch.randint(0, vocab, (3, 7), generator=g)
    targets[0, 0] = 4  # the target is not the one-hot token: log-prob ~ -60
    w_lp, w_ent = torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g)
    x = logits.clone().requires_grad_(True)
    lp, ent = vocab_parallel_log_probs_and_entropy(
        x, targets, vocab_size=vocab, temperature=temperature, chunk=chunk
    )
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    ref_lp, ref_ent, ref_grad = _reference(logits, targets, vocab, temperature, w_lp, w_ent)
    assert lp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(lp.double(), ref_lp.detach(), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent.detach(), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), ref_grad, rtol=1e-6, atol=1e-6)
    assert bool((x.grad[..., vocab:] == 0).all())
    assert torch.equal(logits, x.detach())  # the logits are read, never written


def test_bf16_logits_give_fp32_outputs_and_bf16_gradients():
    g = torch.Generator().manual_seed(1)
    logits = (2 * torch.randn(2, 5, 32, generator=g)).bfloat16().requires_grad_(True)
    targets = torch.randint(0, 30, (2, 5), generator=g)
    lp, ent = vocab_parallel_log_probs_and_entropy(logits, targets, vocab_size=30)
    (lp.sum() + ent.sum()).backward()
    ref_lp, ref_ent, ref_grad = _reference(
        logits.float(), targets, 30, 1.0, torch.ones(2, 5), torch.ones(2, 5)
    )
    assert lp.dtype == torch.float32 and logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(lp.double(), ref_lp.detach(), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent.detach(), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(logits.grad.double(), ref_grad, rtol=1e-2, atol=1e-2)
