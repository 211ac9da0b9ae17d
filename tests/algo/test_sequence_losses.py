"""GSPO, SAPO and GMPO (geo_mean) against per-row loops of the papers' formulas, with explicit
expected gradients (GSPO's sequence ratio is a stop-gradient / straight-through construction)."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algo import (
    compute_policy_loss_geo_mean,
    compute_policy_loss_gspo,
    compute_policy_loss_sapo,
    get_policy_loss,
)
from tests.algo._reference import policy_batch


def _rows(mask):
    return [[t for t, m in enumerate(row) if m] for row in mask.tolist()]


def _seq_mean_token_mean(old, new, adv, mask, token):
    """Loop: loss = sum_i mean_t l_it / N_seq and its gradient, `token(i, t) -> (l, g)`."""
    rows = [r for r in _rows(mask)]
    n_seq = sum(1 for r in rows if r)
    loss, grad = 0.0, torch.zeros(mask.shape, dtype=torch.float64)
    for i, valid in enumerate(rows):
        for t in valid:
            value, slope = token(i, t)
            loss += value / len(valid) / n_seq
            grad[i, t] = slope / len(valid) / n_seq
    return loss, grad


def _assert(loss, new, ref_loss, ref_grad):
    (grad,) = torch.autograd.grad(loss, new)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-5, atol=1e-6)


def test_gspo_sequence_ratio_value_and_token_gradient():
    old, new, adv, mask = policy_batch(0)
    low, high = 0.1, 0.15
    loss, metrics = compute_policy_loss_gspo(
        old, new, adv, mask, clip_ratio_low=low, clip_ratio_high=high,
        loss_agg_mode="seq-mean-token-mean",
    )  # fmt: skip
    o, n, a = old.tolist(), new.tolist(), adv.tolist()
    rows = _rows(mask)
    seq_ratio = [math.exp(sum(n[i][t] - o[i][t] for t in r) / len(r)) if r else 1 for i, r in
                 enumerate(rows)]  # fmt: skip
    clipped_tokens = 0

    def token(i, t):
        nonlocal clipped_tokens
        s, A = seq_ratio[i], a[i][t]
        plain, clipped = -A * s, -A * min(max(s, 1 - low), 1 + high)
        if clipped > plain:
            clipped_tokens += 1
            return clipped, 0.0
        return plain, -A * s  # d/dlogp of exp(sg[log s] + logp - sg[logp]) = s

    ref_loss, ref_grad = _seq_mean_token_mean(o, n, a, mask, token)
    _assert(loss, new, ref_loss, ref_grad)
    assert 0 < clipped_tokens < mask.sum().item()
    assert metrics["pg_clipfrac"].item() == pytest.approx(clipped_tokens / mask.sum().item())


def test_gspo_honours_loss_agg_mode_like_verl():
    """verl 0.9.1's compute_policy_loss_gspo aggregates with the configured loss_agg_mode."""
    old, new, adv, mask = policy_batch(1)
    results = {}
    for mode in ("token-mean", "seq-mean-token-mean"):
        results[mode], _ = get_policy_loss("gspo")(
            old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask,
            loss_agg_mode=mode,
        )  # fmt: skip
    # every token of a sequence carries the same loss value: token-mean weights by length
    per_token = torch.maximum(
        -adv
        * torch.exp(
            ((new - old) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
        ),
        -adv
        * torch.exp(
            ((new - old) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
        ).clamp(0.8, 1.2),
    )
    want = (per_token * mask).sum() / mask.sum()
    torch.testing.assert_close(
        results["token-mean"].detach(), want.detach().to(results["token-mean"].dtype)
    )
    assert results["token-mean"].item() != results["seq-mean-token-mean"].item()


def test_sapo_soft_gate():
    old, new, adv, mask = policy_batch(2)
    tau_pos, tau_neg = 1.0, 1.05
    loss, metrics = compute_policy_loss_sapo(old, new, adv, mask, tau_pos=tau_pos, tau_neg=tau_neg)
    o, n, a = old.tolist(), new.tolist(), adv.tolist()

    def token(i, t):
        r, A = math.exp(n[i][t] - o[i][t]), a[i][t]
        tau = tau_pos if A > 0 else tau_neg
        sig = 1 / (1 + math.exp(-tau * (r - 1)))
        return -A * sig * 4 / tau, -A * 4 * sig * (1 - sig) * r

    _assert(loss, new, *_seq_mean_token_mean(o, n, a, mask, token))
    assert metrics["pg_clipfrac"].item() == 0.0
    # at r = 1 the gate is 2 / tau and its slope is 1: the on-policy gradient
    one = torch.zeros(1, 1, requires_grad=True)
    value, _ = compute_policy_loss_sapo(torch.zeros(1, 1), one, torch.ones(1, 1), torch.ones(1, 1))
    (grad,) = torch.autograd.grad(value, one)
    assert value.item() == pytest.approx(-2.0) and grad.item() == pytest.approx(-1.0)


def _geo_mean_reference(old, new, adv, mask, low, high, weights=None):
    o, n, a = old.tolist(), new.tolist(), adv.tolist()
    rows = _rows(mask)
    n_seq = sum(1 for r in rows if r)
    loss, grad = 0.0, torch.zeros(mask.shape, dtype=torch.float64)
    for i, valid in enumerate(rows):
        if not valid:
            continue
        A = sum(a[i][t] for t in valid) / len(valid)
        kept, slopes = [], {}
        for t in valid:
            d = n[i][t] - o[i][t]
            if A > 0:  # clip only from above: the direction A pushes
                kept.append(min(d, high)), slopes.setdefault(t, 0.0 if d > high else 1.0)
            elif A < 0:
                kept.append(max(d, -low)), slopes.setdefault(t, 0.0 if d < -low else 1.0)
            else:
                kept.append(0.0), slopes.setdefault(t, 0.0)
        ratio = math.exp(sum(kept) / len(valid))
        w = 1.0
        if weights is not None:
            w = math.exp(sum(math.log(weights[i][t] + 1e-10) for t in valid) / len(valid))
        loss += -A * ratio * w / n_seq
        for t in valid:
            grad[i, t] = -A * ratio * w * slopes[t] / len(valid) / n_seq
    return loss, grad


def test_geo_mean_clips_in_the_advantage_direction_only():
    old, new, adv, mask = policy_batch(3, sequence_advantages=True)
    adv[1] = 0.0  # a row with advantage 0 contributes nothing
    low, high = 0.2, 0.3
    loss, metrics = compute_policy_loss_geo_mean(
        old, new, adv, mask, clip_ratio_low=low, clip_ratio_high=high
    )
    _assert(loss, new, *_geo_mean_reference(old, new.detach(), adv, mask, low, high))
    d = (new - old).detach()
    outside = (d < -low) | (d > high)
    valid = mask.bool()
    expected = (outside & (adv > 0) & valid).sum() / valid.sum()
    assert metrics["pg_clipfrac"].item() == pytest.approx(expected.item())
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(
        ((outside & (adv < 0) & valid).sum() / valid.sum()).item()
    )


def test_geo_mean_rollout_weights_and_global_count():
    old, new, adv, mask = policy_batch(4, sequence_advantages=True)
    weights = torch.rand(5, 6, generator=torch.Generator().manual_seed(0)) + 0.5
    loss, _ = compute_policy_loss_geo_mean(
        old, new, adv, mask, clip_ratio=0.25, rollout_is_weights=weights, global_seq_count=10
    )
    ref_loss, ref_grad = _geo_mean_reference(
        old, new.detach(), adv, mask, 0.25, 0.25, weights.tolist()
    )
    n_seq = 4  # the reference divides by the 4 non-empty rows, the call by 10
    _assert(loss, new, ref_loss * n_seq / 10, ref_grad * n_seq / 10)
