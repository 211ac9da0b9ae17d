"""vocab_parallel_sum_pi_squared at TP=1 against a plain softmax (float64)."""

from __future__ import annotations

import pytest
import torch

from megarl.models.logprobs import vocab_parallel_sum_pi_squared


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_a_plain_softmax_and_ignores_padded_columns(temperature):
    g = torch.Generator().manual_seed(0)
    vocab, padded = 50, 64
    logits = 4 * torch.randn(3, 7, padded, generator=g)
    logits[..., vocab:] = 1e4  # padding: would dominate if it were not masked
    logits[0, 0, 3] = 60.0  # a near one-hot position (sum ~ 1)
    got = vocab_parallel_sum_pi_squared(logits, vocab_size=vocab, temperature=temperature, chunk=3)
    pi = torch.softmax(logits[..., :vocab].double() / temperature, dim=-1)
    expected = pi.square().sum(-1)
    assert got.shape == (3, 7) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-7)
    assert got[0, 0].item() == pytest.approx(1.0, abs=1e-5)
    assert bool((got >= 1 / vocab - 1e-7).all()) and bool((got <= 1 + 1e-6).all())


def test_bf16_logits_and_uniform_distribution():
    logits = torch.zeros(2, 4, 16, dtype=torch.bfloat16)
    got = vocab_parallel_sum_pi_squared(logits, vocab_size=16)
    torch.testing.assert_close(got, torch.full((2, 4), 1 / 16))
