"""Rollout log-prob modes and truncated importance-sampling weights."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algo import compute_rollout_is_weights, select_old_log_prob


def test_modes_pick_the_anchor():
    rollout, recomputed = torch.zeros(1, 2), torch.ones(1, 2)
    assert select_old_log_prob("bypass", rollout, recomputed) is rollout
    assert select_old_log_prob("decoupled", rollout, recomputed) is recomputed
    with pytest.raises(ValueError, match="decoupled, bypass"):
        select_old_log_prob("hybrid", rollout, recomputed)
    with pytest.raises(ValueError):
        select_old_log_prob("bypass", None, recomputed)


def test_token_level_truncated_weights():
    old = torch.tensor([[math.log(0.5), math.log(3.0), 0.0]])
    rollout = torch.zeros(1, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    weights, metrics = compute_rollout_is_weights(old, rollout, mask, rollout_is_threshold=2.0)
    assert weights.tolist()[0] == pytest.approx([0.5, 2.0, 0.0])
    assert not weights.requires_grad
    assert metrics["rollout_is_clipped_frac"].item() == pytest.approx(0.5)
    assert metrics["rollout_is_mean"].item() == pytest.approx(1.75)


def test_sequence_level_and_batch_normalize():
    old = torch.tensor([[0.1, 0.2, 5.0], [-0.3, 0.0, 0.0]])
    rollout = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    weights, _ = compute_rollout_is_weights(
        old, rollout, mask, rollout_is="sequence", rollout_is_threshold=10.0
    )
    assert weights[0, :2].tolist() == pytest.approx([math.exp(0.3)] * 2, rel=1e-6)
    assert weights[1, 0].item() == pytest.approx(math.exp(-0.3), rel=1e-6)
    assert weights[0, 2].item() == 0.0 and weights[1, 1:].abs().max().item() == 0.0
    normed, _ = compute_rollout_is_weights(
        old,
        rollout,
        mask,
        rollout_is="sequence",
        rollout_is_threshold=10.0,
        rollout_is_batch_normalize=True,
    )
    mean = (math.exp(0.3) + math.exp(-0.3)) / 2
    assert normed[0, 0].item() == pytest.approx(math.exp(0.3) / mean, rel=1e-6)
    with pytest.raises(ValueError, match="token, sequence"):
        compute_rollout_is_weights(old, rollout, mask, rollout_is="geometric")
