"""masked_sum / masked_mean / masked_var / masked_whiten."""

from __future__ import annotations

import pytest
import torch

from megarl.algo import masked_mean, masked_sum, masked_var, masked_whiten

X = torch.tensor([[1.0, 2.0, float("nan")], [4.0, 5.0, 6.0]])
M = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])


def test_sum_mean_ignore_masked_nan():
    assert masked_sum(X, M).item() == 13.0
    assert masked_mean(X, M).item() == pytest.approx(13 / 4)
    assert masked_mean(X, M, dim=-1).tolist() == pytest.approx([1.5, 5.0])
    assert masked_mean(X, M.bool()).item() == pytest.approx(13 / 4)
    assert masked_mean(X, torch.zeros_like(M)).item() == 0.0


def test_var_unbiased_and_biased():
    vals = torch.tensor([1.0, 2.0, 4.0, 6.0])
    assert masked_var(X, M).item() == pytest.approx(vals.var().item())
    assert masked_var(X, M, unbiased=False).item() == pytest.approx(vals.var(unbiased=False).item())
    one = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert masked_var(X, one).item() == 0.0  # verl raises; megarl returns 0


def test_whiten():
    w = masked_whiten(X, M)
    vals = torch.tensor([1.0, 2.0, 4.0, 6.0])
    expected = (vals - vals.mean()) / torch.sqrt(vals.var() + 1e-8)
    assert torch.stack([w[0, 0], w[0, 1], w[1, 0], w[1, 2]]).tolist() == pytest.approx(
        expected.tolist(), rel=1e-6
    )
    unshifted = masked_whiten(X, M, shift_mean=False)
    assert unshifted[0, 0].item() == pytest.approx(w[0, 0].item() + 13 / 4)
