"""CISPO, DPPO-TV, DPPO-KL and DRO against per-token loops of the papers' formulas, with explicit
expected gradients (their weights are stop-gradient, which gradcheck would get wrong)."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algo import (
    compute_policy_loss_cispo,
    compute_policy_loss_dppo_kl,
    compute_policy_loss_dppo_tv,
    compute_policy_loss_dro,
    get_policy_loss,
)
from tests.algo._reference import policy_batch

LOW, HIGH = 0.2, 0.28


def _loop(old, new, adv, mask, token):
    """Per-token (loss, d loss / d log_prob) from `token(old, new, adv) -> (l, g)`, token-mean."""
    B, T = mask.shape
    count = int(mask.sum())
    loss, grad = 0.0, torch.zeros(B, T, dtype=torch.float64)
    for i in range(B):
        for t in range(T):
            if mask[i, t]:
                value, slope = token(float(old[i, t]), float(new[i, t]), float(adv[i, t]))
                loss += value / count
                grad[i, t] = slope / count
    return loss, grad


def _check(fn, token, seed=0, **kwargs):
    old, new, adv, mask = policy_batch(seed)
    loss, metrics = fn(old, new, adv, mask, **kwargs)
    (grad,) = torch.autograd.grad(loss, new)
    ref_loss, ref_grad = _loop(old, new.detach(), adv, mask, token)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-5, atol=1e-6)
    return metrics, (old, new.detach(), adv, mask)


def _cispo_token(old, new, a):
    weight = min(max(math.exp(new - old), 1 - LOW), 1 + HIGH)
    return -weight * a * new, -weight * a  # the weight carries no gradient


def test_cispo_matches_the_formula_and_keeps_every_gradient():
    metrics, (old, new, _, mask) = _check(
        compute_policy_loss_cispo, _cispo_token, clip_ratio_low=LOW, clip_ratio_high=HIGH
    )
    ratio = torch.exp(new - old)
    outside = ((ratio < 1 - LOW) | (ratio > 1 + HIGH)) & mask.bool()
    assert 0 < outside.sum() < mask.sum()  # the batch exercises the clip
    assert metrics["pg_clipfrac"].item() == pytest.approx(outside.sum().item() / mask.sum().item())
    assert metrics["pg_clipfrac_lower"].item() == 0.0


def _dppo_token(kind, c, low=LOW, high=HIGH):
    def token(old, new, a):
        p, p_old = math.exp(new), math.exp(old)
        if kind == "tv":
            up, down = p - p_old <= high, p - p_old >= -low
        else:
            d = p_old * (old - new) + (1 - p_old) * math.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
            up, down = d <= high or p <= p_old, d <= low or p >= p_old
        keep = up if a > 0 else down
        weight = min(math.exp(new - old), c) if keep else 0.0
        return -a * weight * new, -a * weight

    return token


@pytest.mark.parametrize("kind", ["tv", "kl"])
def test_dppo_matches_the_formula(kind):
    fn = compute_policy_loss_dppo_tv if kind == "tv" else compute_policy_loss_dppo_kl
    # thresholds small enough that some tokens leave the trust region; c = 1.3 truncates some
    _check(fn, _dppo_token(kind, 1.3), clip_ratio_low=LOW, clip_ratio_high=HIGH, clip_ratio_c=1.3)
    metrics, _ = _check(
        fn, _dppo_token(kind, 20.0, 0.05, 0.02), seed=3, clip_ratio_low=0.05, clip_ratio_high=0.02
    )
    assert 0 < metrics["pg_clipfrac"].item() < 1  # some tokens dropped, some kept


@pytest.mark.parametrize("kind", ["tv", "kl"])
def test_dppo_drops_only_tokens_pushed_out_of_the_region(kind):
    fn = compute_policy_loss_dppo_tv if kind == "tv" else compute_policy_loss_dppo_kl
    # p_old = 0.5 -> p = 0.9: far out upwards. A > 0 pushes further up: dropped; A < 0: kept.
    # p_old = 0.5 -> 0.62 (TV 0.12, binary KL 0.029) is just out for delta = 0.1 / 0.025;
    # -> 0.58 (TV 0.08, binary KL 0.013) just in.
    delta = 0.1 if kind == "tv" else 0.025
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5]]))
    new = torch.log(torch.tensor([[0.9, 0.9, 0.62, 0.58]])).requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0, 1.0, 1.0]])
    loss, metrics = fn(old, new, adv, torch.ones(1, 4), clip_ratio=delta, clip_ratio_c=20.0)
    (grad,) = torch.autograd.grad(loss, new)
    assert grad[0, 0].item() == 0.0 and grad[0, 2].item() == 0.0
    assert grad[0, 1].item() == pytest.approx(1.0 * 1.8 / 4, rel=1e-6)  # -A * ratio / N
    assert grad[0, 3].item() == pytest.approx(-1.0 * 1.16 / 4, rel=1e-6)
    assert metrics["pg_clipfrac"].item() == 0.5


def test_dro_matches_the_formula():
    beta = 0.7

    def token(old, new, a):
        return -(a * new - 0.5 * beta * (new - old) ** 2), -a + beta * (new - old)

    _check(compute_policy_loss_dro, token, dro_beta=beta)


def test_dro_needs_a_positive_beta():
    old, new, adv, mask = policy_batch(0)
    for beta in (None, 0.0, -1.0):
        with pytest.raises(ValueError, match="dro_beta"):
            compute_policy_loss_dro(old, new, adv, mask, dro_beta=beta)


@pytest.mark.parametrize("name", ["cispo", "dppo_tv", "dppo_kl", "dro"])
def test_rollout_is_weights_and_aggregation_as_for_vanilla(name):
    """The trainer's call: IS weights multiply the per-token loss; seq-mean-token-sum with
    global counts. Checked against the same loss with the weights folded into the advantages
    (every loss here is linear in A except DRO's penalty, which is checked with A = 0)."""
    old, new, adv, mask = policy_batch(5)
    weights = torch.rand(5, 6, generator=torch.Generator().manual_seed(1)) + 0.5
    loss = get_policy_loss(name)
    settings = {"dro_beta": 0.5, "clip_ratio_c": 3.0, "clip_ratio": 0.2}
    extra = {k: v for k, v in settings.items() if k in loss.settings}
    common = {"loss_agg_mode": "seq-mean-token-sum", "global_seq_count": 8.0}
    if name == "dro":
        adv = torch.zeros_like(adv)
    weighted, _ = loss(
        old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask,
        rollout_is_weights=weights, **extra, **common,
    )  # fmt: skip
    per_token, _ = loss(
        old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask,
        loss_agg_mode="token-sum", **extra,
    )  # fmt: skip
    assert torch.isfinite(weighted) and per_token.item() != 0.0
    # recompute the weighted sum by hand from per-token losses of single tokens
    total = 0.0
    for i in range(5):
        for t in range(6):
            if mask[i, t]:
                one = torch.zeros(5, 6)
                one[i, t] = 1.0
                value, _ = loss(
                    old_log_prob=old, log_prob=new, advantages=adv, response_mask=one,
                    loss_agg_mode="token-sum", **extra,
                )  # fmt: skip
                total += value.item() * weights[i, t].item()
    assert weighted.item() == pytest.approx(total / 8.0, rel=1e-5, abs=1e-6)
