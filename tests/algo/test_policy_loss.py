"""PPO clip, clip-higher, dual-clip, log-ratio clamp, metrics, IS weights, GPG."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algo import (
    compute_policy_loss,
    compute_policy_loss_gpg,
    compute_policy_loss_vanilla,
    get_policy_loss,
)


def one_token(new, old, adv):
    return (
        torch.tensor([[old]]),
        torch.tensor([[new]], requires_grad=True),
        torch.tensor([[adv]]),
        torch.ones(1, 1),
    )


def test_seed_clip_example():
    # seeds/003 §3.5: log-probs -1.5 vs -2.0, A = 0.5, eps = 0.2: ratio 1.65 -> clipped to 1.2
    old, new, adv, mask = one_token(-1.5, -2.0, 0.5)
    loss, metrics = compute_policy_loss_vanilla(old, new, adv, mask, clip_ratio=0.2)
    assert loss.item() == pytest.approx(-0.6, abs=1e-6)
    assert metrics["pg_clipfrac"].item() == 1.0
    assert metrics["pg_clipfrac_lower"].item() == 0.0
    assert metrics["ppo_kl"].item() == pytest.approx(-0.5)
    loss.backward()
    assert new.grad.item() == 0.0  # clipped: no gradient


def test_unclipped_inside_the_trust_region():
    old, new, adv, mask = one_token(-1.9, -2.0, 0.5)
    loss, metrics = compute_policy_loss_vanilla(old, new, adv, mask, clip_ratio=0.2)
    assert loss.item() == pytest.approx(-0.5 * math.exp(0.1), rel=1e-6)
    assert metrics["pg_clipfrac"].item() == 0.0


def test_dual_clip_with_negative_advantage():
    # A = -1, ratio = 5: l1 = 5, l2 = -A*1.2 = 1.2, max = 5; dual bound c*(-A) = 3 -> loss 3
    old, new, adv, mask = one_token(math.log(5.0), 0.0, -1.0)
    loss, metrics = compute_policy_loss_vanilla(
        old, new, adv, mask, clip_ratio=0.2, clip_ratio_c=3.0
    )
    assert loss.item() == pytest.approx(3.0, rel=1e-6)
    assert metrics["pg_clipfrac_lower"].item() == 1.0
    assert metrics["pg_clipfrac"].item() == 0.0
    # ratio 2 is below the dual bound: plain PPO value -A*ratio = 2
    old, new, adv, mask = one_token(math.log(2.0), 0.0, -1.0)
    loss, metrics = compute_policy_loss_vanilla(
        old, new, adv, mask, clip_ratio=0.2, clip_ratio_c=3.0
    )
    assert loss.item() == pytest.approx(2.0, rel=1e-6)
    assert metrics["pg_clipfrac_lower"].item() == 0.0
    # negative advantage, ratio below 1 - eps: clipped at 0.8
    old, new, adv, mask = one_token(math.log(0.5), 0.0, -1.0)
    loss, metrics = compute_policy_loss_vanilla(old, new, adv, mask, clip_ratio=0.2)
    assert loss.item() == pytest.approx(0.8, rel=1e-6)
    assert metrics["pg_clipfrac"].item() == 1.0


def test_clip_higher_uses_separate_bounds():
    old, new, adv, mask = one_token(math.log(1.25), 0.0, 1.0)
    loss, _ = compute_policy_loss_vanilla(
        old, new, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28
    )
    assert loss.item() == pytest.approx(-1.25, rel=1e-6)  # 1.25 < 1.28: not clipped
    loss, _ = compute_policy_loss_vanilla(old, new, adv, mask, clip_ratio=0.2)
    assert loss.item() == pytest.approx(-1.2, rel=1e-6)
    old, new, adv, mask = one_token(math.log(0.75), 0.0, -1.0)
    loss, _ = compute_policy_loss_vanilla(
        old, new, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28
    )
    assert loss.item() == pytest.approx(0.8, rel=1e-6)  # low side still 1 - 0.2


def test_log_ratio_clamped_at_20():
    old, new, adv, mask = one_token(100.0, 0.0, -1.0)
    loss, metrics = compute_policy_loss_vanilla(old, new, adv, mask, clip_ratio_c=1e12)
    assert loss.item() == pytest.approx(math.exp(20.0), rel=1e-5)
    assert metrics["ppo_kl"].item() == pytest.approx(-20.0)


def test_masked_tokens_never_reach_the_loss():
    old = torch.tensor([[0.0, 0.0]])
    new = torch.tensor([[0.1, float("nan")]], requires_grad=True)
    adv = torch.tensor([[1.0, float("inf")]])
    mask = torch.tensor([[1.0, 0.0]])
    loss, metrics = compute_policy_loss_vanilla(old, new, adv, mask)
    assert loss.item() == pytest.approx(-math.exp(0.1), rel=1e-6)
    assert all(torch.isfinite(v) for v in metrics.values())
    loss.backward()
    assert torch.isfinite(new.grad).all()


def test_rollout_is_weights_scale_the_per_token_loss():
    old = torch.zeros(1, 2)
    new = torch.zeros(1, 2)
    adv = torch.ones(1, 2)
    mask = torch.ones(1, 2)
    weights = torch.tensor([[0.5, 2.0]])
    loss, _ = compute_policy_loss_vanilla(old, new, adv, mask, rollout_is_weights=weights)
    assert loss.item() == pytest.approx(-(0.5 + 2.0) / 2)


def test_gpg_and_dispatch():
    old = torch.zeros(1, 2)
    new = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    adv = torch.tensor([[1.0, -0.5]])
    mask = torch.ones(1, 2)
    loss, metrics = compute_policy_loss_gpg(old, new, adv, mask)
    assert loss.item() == pytest.approx((1.0 - 1.0) / 2)
    assert metrics["ppo_kl"].item() == pytest.approx(1.5)
    aggregation = {"loss_agg_mode": "token-mean", "rollout_is_weights": None,
                   "global_token_count": None, "global_seq_count": None,
                   "loss_scale_factor": None, "seq_token_counts": None}  # fmt: skip
    loss2, _ = compute_policy_loss(
        "gpg", old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask, clip_ratio=0.2,
        **aggregation,
    )  # fmt: skip
    assert loss2.item() == loss.item()
    assert get_policy_loss("vanilla") is compute_policy_loss_vanilla


def test_clip_ratio_c_must_exceed_one():
    old, new, adv, mask = one_token(0.0, 0.0, 1.0)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        compute_policy_loss_vanilla(old, new, adv, mask, clip_ratio_c=1.0)


def test_losses_declare_the_flat_inputs_callers_use():
    """`@policy_loss` declares the keyword names (and positional order) the trainer and verl
    users pass; a loss that forces its aggregation does not declare `loss_agg_mode`; an input
    a loss does not declare is a TypeError naming it."""
    from megarl.algo import compute_policy_loss_gspo, compute_policy_loss_sapo

    assert compute_policy_loss_vanilla.inputs == (
        "old_log_prob", "log_prob", "advantages", "response_mask", "loss_agg_mode",
        "rollout_is_weights", "global_token_count", "global_seq_count", "loss_scale_factor",
        "seq_token_counts", "clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c",
    )  # fmt: skip
    assert "loss_agg_mode" not in compute_policy_loss_sapo.inputs
    assert "loss_agg_mode" in compute_policy_loss_gspo.inputs
    with pytest.raises(TypeError, match="clip_ratio_hihg"):
        compute_policy_loss_vanilla(*one_token(0.0, 0.0, 1.0), clip_ratio_hihg=0.3)
