"""KL estimators' formulas, straight-through variants, KL in reward and controllers, KL loss."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algo import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    compute_kl_loss,
    get_kl_controller,
    get_kl_estimator,
    kl_penalty,
)

LP = torch.tensor([[-1.0, -0.5, -3.0]])
REF = torch.tensor([[-1.5, -0.5, -1.0]])
D = [0.5, 0.0, -2.0]  # log_prob - ref_log_prob


def test_k1_abs_k2():
    assert kl_penalty(LP, REF, "kl").tolist()[0] == pytest.approx(D)
    assert kl_penalty(LP, REF, "k1").tolist()[0] == pytest.approx(D)
    assert kl_penalty(LP, REF, "abs").tolist()[0] == pytest.approx([abs(d) for d in D])
    k2 = [0.5 * d * d for d in D]
    assert kl_penalty(LP, REF, "mse").tolist()[0] == pytest.approx(k2)
    assert kl_penalty(LP, REF, "k2").tolist()[0] == pytest.approx(k2)


def test_k3_low_var_kl():
    # r = pi_ref / pi = exp(-d); k3 = r - log r - 1 (verl / Schulman's blog)
    expected = [math.exp(-d) + d - 1 for d in D]
    assert kl_penalty(LP, REF, "low_var_kl").tolist()[0] == pytest.approx(expected, rel=1e-6)
    assert kl_penalty(LP, REF, "k3").tolist()[0] == pytest.approx(expected, rel=1e-6)
    # clamps: log ratio to +-20, the estimate to [-10, 10]
    big = kl_penalty(torch.tensor([[-100.0]]), torch.tensor([[0.0]]), "k3")
    assert big.item() == 10.0
    assert all(v >= 0 for v in kl_penalty(LP, REF, "k3").tolist()[0])


def test_full_kl_over_vocabulary():
    g = torch.Generator().manual_seed(0)
    logits, ref_logits = torch.randn(2, 3, 5, generator=g), torch.randn(2, 3, 5, generator=g)
    lp, ref = torch.log_softmax(logits, -1), torch.log_softmax(ref_logits, -1)
    full = kl_penalty(lp, ref, "full")
    expected = torch.nn.functional.kl_div(ref, lp, log_target=True, reduction="none").sum(-1)
    torch.testing.assert_close(full, expected)
    assert full.shape == (2, 3) and (full >= 0).all()
    with pytest.raises(ValueError, match="full"):
        kl_penalty(LP, REF, "full")


@pytest.mark.parametrize("name", ["kl+", "k1+", "abs+", "low_var_kl+", "k3+"])
def test_straight_through_value_of_estimator_gradient_of_k2(name):
    lp = LP.clone().requires_grad_(True)
    value = kl_penalty(lp, REF, name)
    torch.testing.assert_close(value, kl_penalty(LP, REF, name[:-1]))
    value.sum().backward()
    torch.testing.assert_close(lp.grad, LP - REF)  # d/dlp 0.5 d^2


def test_unknown_estimator_lists_valid_names():
    with pytest.raises(ValueError) as err:
        get_kl_estimator("k4")
    for name in ("kl", "abs", "mse", "low_var_kl", "full", "k1", "k2", "k3"):
        assert name in str(err.value)


def test_kl_in_reward_and_current_kl():
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    old = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5], [-1.0, -2.5, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    rewards, current = apply_kl_penalty(scores, old, ref, mask, kl_coef=0.1, kl_penalty="kl")
    kl = (old - ref) * mask
    torch.testing.assert_close(rewards, scores - 0.1 * kl)
    assert current.item() == pytest.approx(((0.5 + 0 - 0.5) / 3 + (-1.0 + 0.5) / 2) / 2)


def test_fixed_and_adaptive_controllers():
    fixed = get_kl_controller("fixed", kl_coef=0.05)
    fixed.update(current_kl=10.0, n_steps=256)
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.05

    adaptive = get_kl_controller("adaptive", kl_coef=0.1, target_kl=0.01, horizon=10000)
    assert isinstance(adaptive, AdaptiveKLController)
    adaptive.update(current_kl=0.012, n_steps=500)  # error 0.2 -> x(1 + 0.2 * 500/10000)
    assert adaptive.value == pytest.approx(0.1 * 1.01)
    adaptive.update(current_kl=1.0, n_steps=1000)  # error clipped at +0.2
    assert adaptive.value == pytest.approx(0.1 * 1.01 * 1.02)
    adaptive.update(current_kl=0.0, n_steps=1000)  # error clipped at -0.2
    assert adaptive.value == pytest.approx(0.1 * 1.01 * 1.02 * 0.98)
    with pytest.raises(ValueError, match="fixed, adaptive"):
        get_kl_controller("pid")
    with pytest.raises(ValueError, match="horizon"):
        get_kl_controller("adaptive", kl_coef=0.1, target_kl=0.1, horizon=0)


def test_kl_loss_is_aggregated_estimator():
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss = compute_kl_loss(LP, REF, mask, kl_loss_type="low_var_kl", loss_agg_mode="token-mean")
    k3 = kl_penalty(LP, REF, "k3")[0]
    assert loss.item() == pytest.approx((k3[0] + k3[1]).item() / 2)


@pytest.mark.parametrize("name", ["k2+", "mse+"])
def test_k2_plus_is_k2(name):
    """verl 0.9.1 accepts "k2+" / "mse+": k2's value with k2's gradient, i.e. k2 itself."""
    log_prob = torch.tensor([[-1.0, -0.3, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -0.1, -2.0]])
    value = kl_penalty(log_prob, ref, name)
    (grad,) = torch.autograd.grad(value.sum(), log_prob)
    d = log_prob.detach() - ref
    torch.testing.assert_close(value.detach(), 0.5 * d * d, rtol=0, atol=0)
    torch.testing.assert_close(grad, d, rtol=0, atol=0)  # d/dlogp of d^2/2
