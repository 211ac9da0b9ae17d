"""The reverse linear-recurrence engine against a plain loop (float64)."""

from __future__ import annotations

import pytest
import torch

from megarl.algo.scan import discounted_reverse_cumsum, exclusive_cumsum
from tests.algo._reference import linear_recurrence


@pytest.mark.parametrize("decay", [1.0, 0.9405, 0.3, 1e-3, 0.0])
@pytest.mark.parametrize("with_breaks", [False, True])
@pytest.mark.parametrize("with_steps", [False, True])
def test_matches_loop(decay, with_breaks, with_steps):
    g = torch.Generator().manual_seed(11)
    batch, length = 6, 700  # > one block for decay 0.3 and 1e-3
    x = torch.randn(batch, length, generator=g, dtype=torch.float64)
    steps = torch.rand(batch, length, generator=g) > 0.3 if with_steps else None
    breaks = torch.rand(batch, length, generator=g) > 0.97 if with_breaks else None
    factors = torch.full((batch, length), decay, dtype=torch.float64)
    if steps is not None:
        factors = torch.where(steps, factors, torch.ones_like(factors))
    if breaks is not None:
        factors = torch.where(breaks, torch.zeros_like(factors), factors)
    exponents = None if steps is None else exclusive_cumsum(steps)
    y = discounted_reverse_cumsum(x, decay, exponents=exponents, breaks=breaks)
    torch.testing.assert_close(y, linear_recurrence(x, factors), rtol=1e-9, atol=1e-9)


def test_long_rows_with_strong_decay_stay_finite():
    # decay**4096 underflows float64 unless the row is cut into blocks.
    x = torch.ones(2, 4096, dtype=torch.float64)
    y = discounted_reverse_cumsum(x, 0.5)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y[:, :-60], torch.full_like(y[:, :-60], 2.0))
    assert y[0, -1].item() == pytest.approx(1.0) and y[0, -2].item() == pytest.approx(1.5)


def test_rejects_decay_outside_unit_interval():
    with pytest.raises(ValueError, match="decay"):
        discounted_reverse_cumsum(torch.zeros(1, 3), 1.5)


def test_exclusive_cumsum():
    mask = torch.tensor([[1, 0, 1, 1, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    assert exclusive_cumsum(mask).tolist() == [[0, 1, 1, 2, 3], [0, 0, 0, 0, 0]]
