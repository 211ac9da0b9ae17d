"""GDPO and the optimal-token-baseline estimators against per-group loops written from the
formulas; uneven groups, a group of one (advantage 0), ragged masks with interior zeros."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algo import (
    compute_advantage,
    compute_gdpo_outcome_advantage,
    compute_grpo_outcome_advantage,
    compute_optimal_token_baseline_advantage,
    compute_tir_optimal_token_baseline_advantage,
)
from tests.algo._reference import groups, whiten

INDEX = ["a", "a", "a", "b", "b", "c", "d", "d"]  # groups of 3, 2, 1 and 2
MASK = torch.tensor(
    [
        [1, 1, 1, 1, 0],
        [1, 1, 0, 0, 0],
        [1, 0, 1, 1, 1],  # interior zero
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1],
        [1, 1, 0, 0, 0],  # the group of one
        [0, 0, 0, 0, 0],  # an empty response
        [1, 0, 0, 1, 0],
    ]
)


def _group_normalised(scores, epsilon=1e-6, by_std=True):
    out = [0.0] * len(scores)
    for members in groups(INDEX):
        if len(members) < 2:
            continue
        values = [scores[i] for i in members]
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
        for i in members:
            out[i] = (scores[i] - mean) / (std + epsilon) if by_std else scores[i] - mean
    return out


@pytest.mark.parametrize("by_std", [True, False])
def test_gdpo_normalises_each_component_then_whitens(by_std):
    g = torch.Generator().manual_seed(0)
    correct = (torch.rand(8, generator=g) > 0.5).float()
    length_penalty = -torch.rand(8, generator=g) * 10  # a dominant scale
    weights = [2.0, 0.5]
    adv, returns = compute_gdpo_outcome_advantage(
        torch.zeros(8, 5), MASK, INDEX,
        norm_adv_by_std_in_grpo=by_std,
        reward_components={"correct": correct, "length": length_penalty, "unused": correct},
        gdpo_reward_keys=["correct", "length"],
        gdpo_reward_weights=weights,
    )  # fmt: skip
    a = _group_normalised(correct.tolist(), by_std=by_std)
    b = _group_normalised(length_penalty.tolist(), by_std=by_std)
    combined = torch.tensor([weights[0] * x + weights[1] * y for x, y in zip(a, b, strict=True)])
    in_group = torch.tensor([len([j for j in INDEX if j == i]) > 1 for i in INDEX])
    mask = MASK.bool() & in_group[:, None]  # the group of one stays out of the statistics
    expected = whiten(combined[:, None].expand(8, 5), mask) * mask
    torch.testing.assert_close(adv.double(), expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(adv, returns)
    assert adv[5].abs().sum() == 0  # the group of one gets 0


def test_gdpo_single_reward_fallback_is_whitened_grpo():
    g = torch.Generator().manual_seed(1)
    rewards = torch.zeros(8, 5)
    rewards[:, 0] = torch.randn(8, generator=g)
    adv, _ = compute_advantage(
        "gdpo", token_level_rewards=rewards, response_mask=MASK, index=INDEX,
        norm_adv_by_std_in_grpo=True, reward_components=None, gdpo_reward_keys=None,
        gdpo_reward_weights=None,
    )  # fmt: skip
    grpo, _ = compute_grpo_outcome_advantage(rewards, MASK, INDEX)
    mask = MASK.bool().clone()
    mask[5] = False
    torch.testing.assert_close(adv.double(), whiten(grpo, mask) * mask, rtol=1e-5, atol=1e-6)


def test_gdpo_names_a_missing_key_and_a_weight_count_mismatch():
    with pytest.raises(ValueError, match="format"):
        compute_gdpo_outcome_advantage(
            torch.zeros(8, 5), MASK, INDEX, reward_components={"acc": torch.zeros(8)},
            gdpo_reward_keys=["acc", "format"],
        )  # fmt: skip
    with pytest.raises(ValueError, match="gdpo_reward_weights"):
        compute_gdpo_outcome_advantage(
            torch.zeros(8, 5), MASK, INDEX, reward_components={"acc": torch.zeros(8)},
            gdpo_reward_keys=["acc"], gdpo_reward_weights=[1.0, 2.0],
        )  # fmt: skip


def _otb_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(8, 5, generator=g) * MASK
    old_log_prob = -torch.rand(8, 5, generator=g) * 3
    pi = torch.exp(old_log_prob)
    # a plausible sum of squares: at least pi^2, at most 1
    sum_pi_squared = pi**2 + (1 - pi) ** 2 * torch.rand(8, 5, generator=g)
    rho = 0.5 + torch.rand(8, 5, generator=g)
    return rewards, old_log_prob, sum_pi_squared, rho


def _otb_loop(rewards, old_log_prob, sum_pi_squared, rho, tir, zero_tail, epsilon=1e-8):
    """The estimator written per response and per position, float64."""
    B, T = MASK.shape
    valid = [[t for t in range(T) if MASK[i, t]] for i in range(B)]
    G = torch.zeros(B, T, dtype=torch.float64)
    W = torch.zeros(B, T, dtype=torch.float64)
    for i in range(B):
        cumulative = 0.0
        for t in range(T):
            if MASK[i, t]:
                pi = math.exp(float(old_log_prob[i, t]))
                w = 1 - 2 * pi + float(sum_pi_squared[i, t])
                cumulative += w * (float(rho[i, t]) ** 2 if rho is not None else 1.0)
                G[i, t] = sum(float(rewards[i, s]) for s in valid[i] if s >= t)
            W[i, t] = cumulative

    def slot(i, t):  # the position responses are lined up by
        return valid[i].index(t) if tir else t

    advantages = torch.zeros(B, T, dtype=torch.float64)
    for members in groups(INDEX):
        if tir:
            members = [i for i in members if valid[i]]
        if len(members) < 2:
            continue  # megarl: a group of one gets 0 (verl: its return)
        lengths = sorted((len(valid[i]), i) for i in members)
        cut = {}
        if zero_tail and lengths[-1][0] > lengths[-2][0]:
            cut[lengths[-1][1]] = lengths[-2][0]
        for i in members:
            for t in valid[i]:
                k = slot(i, t)
                num = den = 0.0
                for j in members:
                    for s in valid[j]:
                        if slot(j, s) == k:
                            num += float(G[j, s] * W[j, s])
                            den += float(W[j, s])
                baseline = num / (den + epsilon)
                if i in cut and k >= cut[i]:
                    baseline = 0.0
                advantages[i, t] = G[i, t] - baseline
    return advantages, G


@pytest.mark.parametrize("tir", [False, True])
@pytest.mark.parametrize("zero_tail", [True, False])
@pytest.mark.parametrize("with_rho", [False, True])
def test_optimal_token_baseline_matches_the_loop(tir, zero_tail, with_rho):
    rewards, old_log_prob, sum_pi_squared, rho = _otb_inputs(2)
    rho = rho if with_rho else None
    fn = (
        compute_tir_optimal_token_baseline_advantage if tir
        else compute_optimal_token_baseline_advantage
    )  # fmt: skip
    adv, returns = fn(
        rewards, MASK, INDEX, old_log_prob, sum_pi_squared, rollout_is_weights=rho,
        handle_zero_tail=zero_tail,
    )  # fmt: skip
    ref_adv, ref_returns = _otb_loop(rewards, old_log_prob, sum_pi_squared, rho, tir, zero_tail)
    torch.testing.assert_close(adv.double(), ref_adv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close((returns * MASK).double(), ref_returns, rtol=1e-5, atol=1e-5)
    assert adv[5].abs().sum() == 0 and adv[~MASK.bool()].abs().sum() == 0


def test_otb_variants_differ_where_an_interior_zero_shifts_positions():
    rewards, old_log_prob, sum_pi_squared, _ = _otb_inputs(3)
    args = (rewards, MASK, INDEX, old_log_prob, sum_pi_squared)
    plain, _ = compute_optimal_token_baseline_advantage(*args)
    tir, _ = compute_tir_optimal_token_baseline_advantage(*args)
    assert not torch.allclose(plain[:3], tir[:3])  # group "a" holds the interior zero


def test_estimators_run_through_compute_advantage_with_a_trainer_batch():
    """The trainer passes every batch field to whichever estimator the config names."""
    rewards, old_log_prob, sum_pi_squared, rho = _otb_inputs(4)
    batch = {
        "token_level_rewards": rewards, "response_mask": MASK, "index": INDEX,
        "values": torch.zeros(8, 5), "old_log_prob": old_log_prob,
        "sum_pi_squared": sum_pi_squared, "rollout_is_weights": rho, "gamma": 1.0, "lam": 1.0,
        "norm_adv_by_std_in_grpo": True, "reward_components": {"acc": rewards.sum(-1)},
        "gdpo_reward_keys": ["acc"], "gdpo_reward_weights": [1.0],
    }  # fmt: skip
    for name in ("gdpo", "optimal_token_baseline", "tir_optimal_token_baseline"):
        adv, returns = compute_advantage(name, **batch)
        assert adv.shape == returns.shape == (8, 5) and torch.isfinite(adv).all()


def test_gdpo_two_components_by_hand():
    """Two components, weights 1 and 0.5, one response position each. Groups: A = rows 0-2,
    B = rows 3-4 (acc has no variance there), C = row 5 (a group of one: 0, megarl's rule).
    acc A [1,0,0]: mean 1/3, unbiased std sqrt(1/3) -> [1.1547, -0.57735, -0.57735]; B 0.
    fmt A [1,1,1] -> 0; B [0,1]: std sqrt(1/2) -> [-0.70711, 0.70711], weighted 0.5.
    Sum [1.1547, -0.57735, -0.57735, -0.35355, 0.35355]: mean 0, unbiased var 2.25/4, std 0.75;
    whitened: the sum / 0.75."""
    index = torch.tensor([0, 0, 0, 1, 1, 2])
    acc = torch.tensor([1.0, 0, 0, 1, 1, 1])
    fmt = torch.tensor([1.0, 1, 1, 0, 1, 0])
    adv, _ = compute_gdpo_outcome_advantage(
        torch.zeros(6, 1), torch.ones(6, 1), index,
        reward_components={"acc": acc, "fmt": fmt}, gdpo_reward_keys=["acc", "fmt"],
        gdpo_reward_weights=[1.0, 0.5],
    )  # fmt: skip
    expected = [1.539601, -0.769800, -0.769800, -0.471405, 0.471405, 0.0]
    torch.testing.assert_close(adv[:, 0], torch.tensor(expected), atol=2e-5, rtol=0)
