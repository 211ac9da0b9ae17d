"""Outcome-reward estimators over groups: hand-computed values and per-group reference loops."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch

from megarl.algo import (
    compute_advantage,
    compute_gpg_outcome_advantage,
    compute_grpo_outcome_advantage,
    compute_grpo_passk_outcome_advantage,
    compute_opo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_rloo_outcome_advantage,
    group_ids,
)
from tests.algo._reference import group_scalars, whiten


def outcome_batch(scores, length=4, lengths=None):
    """Rewards [B, T] with each score on the last valid token, and the response mask."""
    scores = torch.as_tensor(scores, dtype=torch.float32)
    batch = scores.shape[0]
    lengths = torch.full((batch,), length) if lengths is None else torch.as_tensor(lengths)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    rewards = torch.zeros(batch, length)
    rows = torch.nonzero(lengths > 0).flatten()
    rewards[rows, lengths[rows] - 1] = scores[rows]
    return rewards, mask


def test_grpo_z_score():
    # seed 000 §2.1 / 004: advantage_i = (r_i - mean) / std within the group (std unbiased, as verl)
    rewards, mask = outcome_batch([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    index = [0, 0, 0, 1, 1, 1]
    adv, returns = compute_grpo_outcome_advantage(rewards, mask, index, epsilon=0.0)
    std0 = torch.tensor([1.0, 0.0, 1.0]).std().item()  # 0.57735
    expected = [(1 - 2 / 3) / std0, (0 - 2 / 3) / std0, (1 - 2 / 3) / std0]
    expected += [(1 - 1 / 3) / std0, (0 - 1 / 3) / std0, (0 - 1 / 3) / std0]
    assert adv[:, 0].tolist() == pytest.approx(expected, rel=1e-6)
    assert torch.equal(adv, returns)
    assert torch.equal(adv, adv[:, :1].expand_as(adv) * mask)


def test_dr_grpo_only_centres():
    rewards, mask = outcome_batch([3.0, 1.0, 2.0, 6.0])
    adv, _ = compute_grpo_outcome_advantage(
        rewards, mask, [0, 0, 0, 0], norm_adv_by_std_in_grpo=False
    )
    assert adv[:, 0].tolist() == pytest.approx([0.0, -2.0, -1.0, 3.0])


def test_grpo_epsilon_and_equal_scores():
    rewards, mask = outcome_batch([1.0, 3.0, 5.0, 5.0])
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, [0, 0, 1, 1], epsilon=0.5)
    std = 2**0.5
    assert adv[:2, 0].tolist() == pytest.approx([-1 / (std + 0.5), 1 / (std + 0.5)])
    assert adv[2:].abs().max().item() == 0.0  # std 0 -> 0, not NaN


def test_rloo_leave_one_out_baseline():
    # seed 000 §3.1: baseline_i = (sum_j r_j - r_i) / (n - 1)
    scores = [1.0, 0.0, 0.5, 2.0]
    rewards, mask = outcome_batch(scores)
    adv, _ = compute_rloo_outcome_advantage(rewards, mask, [7, 7, 7, 7])
    total = sum(scores)
    expected = [r - (total - r) / 3 for r in scores]
    assert adv[:, 0].tolist() == pytest.approx(expected)
    assert (adv * (1 - mask)).abs().max().item() == 0.0


def test_opo_length_weighted_baseline():
    scores, lengths = [1.0, 0.0, 1.0], [2, 4, 1]
    rewards, mask = outcome_batch(scores, length=4, lengths=lengths)
    adv, _ = compute_opo_outcome_advantage(rewards, mask, ["a", "a", "a"])
    baseline = (2 * 1.0 + 4 * 0.0 + 1 * 1.0) / 7
    assert adv[0, 0].item() == pytest.approx(1 - baseline)
    assert adv[1, 0].item() == pytest.approx(0 - baseline)
    assert adv[2, 0].item() == pytest.approx(1 - baseline)
    assert adv[2, 1:].abs().max().item() == 0.0


def test_gpg_alpha_scaling():
    scores = [1.0, 0.0, 0.0, 0.0]  # one non-zero score out of 4: alpha = 4
    rewards, mask = outcome_batch(scores)
    adv, _ = compute_gpg_outcome_advantage(rewards, mask, [0, 0, 1, 1], f_norm=2.0)
    assert adv[:, 0].tolist() == pytest.approx([4 * 0.5 / 2, 4 * -0.5 / 2, 0.0, 0.0])


def test_grpo_passk_only_best_gets_the_gap():
    scores = [0.2, 0.9, 0.5, 1.0, 1.0, 0.0]
    rewards, mask = outcome_batch(scores)
    index = [0, 0, 0, 1, 1, 1]
    adv, _ = compute_grpo_passk_outcome_advantage(
        rewards, mask, index, norm_adv_by_std_in_grpo=False
    )
    assert adv[:, 0].tolist() == pytest.approx([0.0, 0.4, 0.0, 0.0, 0.0, 0.0])  # tie -> 0
    adv, _ = compute_grpo_passk_outcome_advantage(rewards, mask, index, epsilon=0.0)
    std = torch.tensor(scores[:3]).std().item()
    assert adv[1, 0].item() == pytest.approx(0.4 / std, rel=1e-6)


def test_reinforce_plus_plus_baseline_centres_then_whitens():
    scores = [1.0, 0.0, 0.0, 2.0, 1.0, 3.0]
    rewards, mask = outcome_batch(scores, length=3, lengths=[3, 2, 1, 3, 3, 2])
    index = [0, 0, 0, 1, 1, 1]
    adv, _ = compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, index)
    centred = torch.tensor([2 / 3, -1 / 3, -1 / 3, 0.0, -1.0, 1.0], dtype=torch.float64)
    expected = whiten(centred[:, None] * mask.double(), mask) * mask.double()
    torch.testing.assert_close(adv.double(), expected, rtol=1e-6, atol=1e-6)


ESTIMATORS = {
    "grpo": compute_grpo_outcome_advantage,
    "rloo": compute_rloo_outcome_advantage,
    "opo": compute_opo_outcome_advantage,
    "gpg": compute_gpg_outcome_advantage,
    "grpo_passk": compute_grpo_passk_outcome_advantage,
    "reinforce_plus_plus_baseline": compute_reinforce_plus_plus_baseline_outcome_advantage,
}


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_group_of_one_gets_zero_never_nan(name):
    rewards, mask = outcome_batch([0.7, 1.0, 0.0, 0.3])
    adv, returns = ESTIMATORS[name](rewards, mask, ["solo", "pair", "pair", "other"])
    assert torch.isfinite(adv).all() and torch.isfinite(returns).all()
    assert adv[0].abs().max().item() == 0.0 and adv[3].abs().max().item() == 0.0
    # a batch made only of groups of one
    adv, _ = ESTIMATORS[name](rewards, mask, [0, 1, 2, 3])
    assert adv.abs().max().item() == 0.0


def test_index_kinds_agree():
    g = torch.Generator().manual_seed(5)
    rewards, mask = outcome_batch(torch.rand(12, generator=g))
    labels = torch.tensor([3, 1, 3, 2, 1, 2, 3, 1, 2, 9, 9, 9])
    uuids = {k: str(uuid.uuid4()) for k in range(10)}
    reference, _ = compute_grpo_outcome_advantage(rewards, mask, labels)
    for index in (
        labels.numpy(),
        labels.tolist(),
        [uuids[k] for k in labels.tolist()],
        np.array([uuids[k] for k in labels.tolist()], dtype=object),
    ):
        adv, _ = compute_grpo_outcome_advantage(rewards, mask, index)
        torch.testing.assert_close(adv, reference)
    ids, count = group_ids(labels)
    assert count == 4 and ids.tolist() == [2, 0, 2, 1, 0, 1, 2, 0, 1, 3, 3, 3]


def _reference_rule(name, epsilon=1e-6):
    if name == "grpo":
        return lambda g, k: (g[k] - g.mean()) / (g.std() + epsilon)
    if name == "grpo_nostd":
        return lambda g, k: g[k] - g.mean()
    if name == "rloo":
        return lambda g, k: g[k] - (g.sum() - g[k]) / (len(g) - 1)
    raise KeyError(name)


@pytest.mark.parametrize("name", ["grpo", "grpo_nostd", "rloo"])
def test_randomized_against_per_group_loop(name):
    g = torch.Generator().manual_seed(17)
    batch, length = 300, 16
    lengths = torch.randint(1, length + 1, (batch,), generator=g)
    scores = torch.randint(0, 3, (batch,), generator=g).float() * torch.rand(batch, generator=g)
    rewards, mask = outcome_batch(scores, length=length, lengths=lengths)
    index = torch.randint(0, 60, (batch,), generator=g)  # uneven group sizes, some singletons
    if name == "rloo":
        adv, _ = compute_rloo_outcome_advantage(rewards, mask, index)
    else:
        adv, _ = compute_grpo_outcome_advantage(
            rewards, mask, index, norm_adv_by_std_in_grpo=(name == "grpo")
        )
    expected = group_scalars(rewards.sum(-1), index.tolist(), _reference_rule(name))
    torch.testing.assert_close(
        adv.double(), expected[:, None] * mask.double(), rtol=1e-5, atol=1e-6
    )


def test_dispatch_by_config_name_ignores_unused_inputs():
    rewards, mask = outcome_batch([1.0, 0.0])
    adv, _ = compute_advantage(
        "rloo",
        token_level_rewards=rewards,
        response_mask=mask,
        index=[0, 0],
        values=torch.zeros_like(rewards),
        gamma=0.99,
        lam=0.95,
        norm_adv_by_std_in_grpo=True,
    )
    assert adv[:, 0].tolist() == pytest.approx([1.0, -1.0])
