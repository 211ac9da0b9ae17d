"""REINFORCE++ (discounted returns with reset) and ReMax."""

from __future__ import annotations

import pytest
import torch

from megarl.algo import (
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    get_adv_estimator,
)
from tests.algo._reference import reinforce_plus_plus_returns, whiten


def test_reinforce_plus_plus_hand_example():
    # seed 000 §3.2: R_t = r_t + gamma * R_{t+1}; advantages = whitened returns on valid tokens
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 2.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    adv, returns = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.5)
    assert returns[0, :3].tolist() == pytest.approx([0.25, 0.5, 1.0])
    assert returns[1, :2].tolist() == pytest.approx([1.0, 2.0])
    expected = whiten(returns.double(), mask) * mask
    torch.testing.assert_close(adv.double(), expected, rtol=1e-6, atol=1e-6)
    assert adv[0, 3].item() == 0.0


def test_reinforce_plus_plus_carries_the_return_through_a_masked_span():
    # verl 0.9.1: the masked step (holding a stray reward 5) neither discounts nor adds; return 0
    rewards = torch.tensor([[0.0, 5.0, 0.0, 1.0]])
    mask = torch.tensor([[1, 0, 1, 1]])
    _, returns = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.5)
    assert returns.tolist() == [[0.25, 0.0, 0.5, 1.0]]  # pre-0.9.1 reset gave [0.0, 5.25, ...]


def test_reinforce_plus_plus_right_padding_ignores_padded_rewards():
    rewards = torch.tensor([[1.0, 2.0, 3.0, 7.0], [4.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[True, True, True, False], [True, False, False, False]])
    _, returns = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.5)
    assert returns.tolist() == [
        [1.0 + 0.5 * 2.0 + 0.25 * 3.0, 2.0 + 0.5 * 3.0, 3.0, 0.0],
        [4.0] + [0.0] * 3,
    ]


@pytest.mark.parametrize("gamma", [1.0, 0.99, 0.3])
def test_reinforce_plus_plus_matches_loop_with_interior_zeros(gamma):
    g = torch.Generator().manual_seed(3)
    rewards = torch.randn(8, 1000, generator=g)
    mask = (torch.rand(8, 1000, generator=g) > 0.1).float()
    mask[1, 600:] = 0.0  # right padding after interior zeros
    mask[2] = 0.0  # an empty row
    adv, returns = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=gamma)
    ref = reinforce_plus_plus_returns(rewards, mask, gamma)
    torch.testing.assert_close(returns.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(adv.double(), whiten(ref, mask) * mask, rtol=1e-5, atol=1e-5)


def test_remax_subtracts_greedy_baseline():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    baselines = torch.tensor([0.25, 1.0])
    adv, returns = compute_remax_outcome_advantage(rewards, baselines, mask)
    assert returns.tolist() == [[1.0, 1.0, 1.0], [0.5, 0.5, 0.0]]
    assert adv.tolist() == [[0.75, 0.75, 0.75], [-0.5, -0.5, 0.0]]
    assert get_adv_estimator("remax") is compute_remax_outcome_advantage
