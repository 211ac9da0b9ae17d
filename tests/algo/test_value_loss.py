"""Clipped value loss and entropy."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algo import compute_entropy_loss, compute_value_loss, entropy_from_logits


def test_value_clipping_takes_the_larger_loss():
    vpreds = torch.tensor([[1.0, 0.45, 0.0]], requires_grad=True)
    values = torch.tensor([[0.5, 0.5, 0.0]])
    returns = torch.tensor([[2.0, 0.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, metrics = compute_value_loss(vpreds, returns, values, mask, cliprange_value=0.2)
    # token 0: unclipped (1-2)^2 = 1, clipped v=0.7: (0.7-2)^2 = 1.69 -> 1.69
    # token 1: within the window: (0.45)^2 = 0.2025 both
    assert loss.item() == pytest.approx(0.5 * (1.69 + 0.2025) / 2)
    assert metrics["vf_clipfrac"].item() == pytest.approx(0.5)
    loss.backward()
    assert vpreds.grad[0, 0].item() == 0.0  # the clipped branch has no gradient
    loss_nc, _ = compute_value_loss(vpreds, returns, values, mask, cliprange_value=None)
    assert loss_nc.item() == pytest.approx(0.5 * (1.0 + 0.2025) / 2)


def test_entropy_from_logits():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]]])
    ent = entropy_from_logits(logits)
    assert ent[0, 0].item() == pytest.approx(math.log(4))
    assert ent[0, 1].item() == pytest.approx(0.0, abs=1e-6)
    mask = torch.tensor([[1.0, 0.0]])
    assert compute_entropy_loss(logits, mask).item() == pytest.approx(math.log(4))
