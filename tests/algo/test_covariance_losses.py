"""KL-Cov and Clip-Cov against loops over the valid tokens (covariance, top-k / candidates), with
explicit expected gradients; Clip-Cov's random subset comes from the generator passed in."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algo import (
    compute_policy_loss,
    compute_policy_loss_clip_cov,
    compute_policy_loss_kl_cov,
    micro_batch_generator,
)
from tests.algo._reference import policy_batch


def _valid_tokens(old, new, adv, mask):
    """[(i, t, old, new, A, covariance)] in row-major order, means over the valid tokens."""
    cells = [(i, t) for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t]]
    mean_a = sum(float(adv[i, t]) for i, t in cells) / len(cells)
    mean_lp = sum(float(new[i, t]) for i, t in cells) / len(cells)
    return [
        (i, t, float(old[i, t]), float(new[i, t]), float(adv[i, t]),
         (float(adv[i, t]) - mean_a) * (float(new[i, t]) - mean_lp))
        for i, t in cells
    ]  # fmt: skip


def test_kl_cov_penalises_the_top_covariance_tokens():
    old, new, adv, mask = policy_batch(0)
    ratio, coef = 0.2, 0.5
    loss, metrics = compute_policy_loss_kl_cov(
        old, new, adv, mask, kl_cov_ratio=ratio, ppo_kl_coef=coef
    )
    tokens = _valid_tokens(old, new.detach(), adv, mask)
    k = max(1, int(len(tokens) * ratio))
    chosen = {(i, t) for i, t, *_ in sorted(tokens, key=lambda c: -c[5])[:k]}
    ref_loss, ref_grad = 0.0, torch.zeros(5, 6, dtype=torch.float64)
    for i, t, o, n, a, _ in tokens:
        r = math.exp(n - o)
        value, slope = -a * r, -a * r
        if (i, t) in chosen:
            value += coef * abs(n - o)
            slope += coef * math.copysign(1.0, n - o)
        ref_loss += value / len(tokens)
        ref_grad[i, t] = slope / len(tokens)
    (grad,) = torch.autograd.grad(loss, new)
    assert k == 3 and loss.item() == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-5, atol=1e-6)
    mean_abs = sum(abs(n - o) for _, _, o, n, *_ in tokens) / len(tokens)
    assert metrics["ppo_kl"].item() == pytest.approx(mean_abs, rel=1e-5)


def _ppo_token(o, n, a, low, high):
    r = math.exp(n - o)
    plain, clipped = -a * r, -a * min(max(r, 1 - low), 1 + high)
    return (clipped, 0.0, True) if clipped > plain else (plain, -a * r, False)


def _clip_cov(seed, generator, ratio, lb=0.02, ub=5.0, clip=0.2):
    # no zero advantage: a dropped token then always shows as a zero gradient
    old, new, adv, mask = policy_batch(seed, zero_advantage=False)
    loss, metrics = compute_policy_loss_clip_cov(
        old, new, adv, mask, generator=generator, clip_ratio=clip, clip_cov_ratio=ratio,
        clip_cov_lb=lb, clip_cov_ub=ub,
    )  # fmt: skip
    (grad,) = torch.autograd.grad(loss, new)
    tokens = _valid_tokens(old, new.detach(), adv, mask)
    candidates = {
        (i, t) for i, t, o, n, a, cov in tokens
        if lb < cov < ub and not _ppo_token(o, n, a, clip, clip)[2]
    }  # fmt: skip
    return loss, grad, metrics, tokens, candidates


def _reference(tokens, dropped, clip=0.2):
    loss, grad = 0.0, torch.zeros(5, 6, dtype=torch.float64)
    for i, t, o, n, a, _ in tokens:
        if (i, t) in dropped:
            continue
        value, slope, _ = _ppo_token(o, n, a, clip, clip)
        loss += value / len(tokens)
        grad[i, t] = slope / len(tokens)
    return loss, grad


def test_clip_cov_drops_every_candidate_when_the_budget_allows():
    loss, grad, metrics, tokens, candidates = _clip_cov(4, micro_batch_generator(0, 0, 0), 0.9)
    assert 1 < len(candidates) < len(tokens)
    ref_loss, ref_grad = _reference(tokens, candidates)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-5, atol=1e-6)
    assert metrics["pg_clipfrac"].item() == pytest.approx(len(candidates) / len(tokens))


def test_clip_cov_random_subset_comes_from_the_generator():
    ratio = 0.15  # budget floor(15 * 0.15) = 2 of the candidates
    picks = []
    for index in range(6):
        loss, grad, _, tokens, candidates = _clip_cov(4, micro_batch_generator(7, 3, index), ratio)
        _, full_grad = _reference(tokens, set())
        dropped = {(i, t) for i, t, *_ in tokens if grad[i, t] == 0 and full_grad[i, t] != 0}
        assert len(dropped) == 2 and dropped <= candidates
        ref_loss, ref_grad = _reference(tokens, dropped)
        assert loss.item() == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
        torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-5, atol=1e-6)
        picks.append(frozenset(dropped))
    assert len(set(picks)) > 1  # micro-batch indices draw different subsets
    again = _clip_cov(4, micro_batch_generator(7, 3, 0), ratio)[1]
    first = _clip_cov(4, micro_batch_generator(7, 3, 0), ratio)[1]
    assert torch.equal(again, first)  # the same (seed, step, index): the same subset


def test_clip_cov_needs_a_generator():
    old, new, adv, mask = policy_batch(0)
    with pytest.raises(ValueError, match="generator"):
        compute_policy_loss("clip_cov", old_log_prob=old, log_prob=new, advantages=adv,
                            response_mask=mask)  # fmt: skip


def test_micro_batch_generators_differ_by_each_coordinate():
    draws = {
        tuple(torch.rand(4, generator=micro_batch_generator(*key)).tolist())
        for key in [(0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1)]
    }
    assert len(draws) == 4
