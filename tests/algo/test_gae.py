"""GAE: the seed's worked example and the vectorized form against verl's per-step recurrence."""

from __future__ import annotations

import pytest
import torch

from megarl.algo import compute_gae_advantage_return, get_adv_estimator, masked_whiten
from tests.algo._reference import gae_recurrence, whiten


def test_seed_worked_example():
    # seeds/003 §2.5: T=4 (2 prompt + 2 response tokens), reward 1.0 on the last token.
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[0.2, 0.3, 0.4, 0.5]])
    mask = torch.tensor([[0.0, 0.0, 1.0, 1.0]])
    adv, returns = compute_gae_advantage_return(
        rewards, values, mask, gamma=0.99, lam=0.95, whiten=False
    )
    # delta_3 = 1 - 0.5 = 0.5, A_3 = 0.5; delta_2 = 0.99*0.5 - 0.4 = 0.095, A_2 = 0.095 + 0.9405*0.5
    assert adv[0, 3].item() == pytest.approx(0.5, abs=5e-4)
    assert adv[0, 2].item() == pytest.approx(0.565, abs=5e-4)
    assert round(adv[0, 2].item(), 3) == 0.565 and round(adv[0, 3].item(), 3) == 0.5
    # Masked positions: the seed writes 0; megarl (like verl) carries the running value, here A_2.
    assert adv[0, :2].tolist() == pytest.approx([adv[0, 2].item()] * 2)
    assert returns[0].tolist() == pytest.approx((adv[0] + values[0]).tolist())


def test_seed_example_whitened_over_valid_tokens():
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[0.2, 0.3, 0.4, 0.5]])
    mask = torch.tensor([[0.0, 0.0, 1.0, 1.0]])
    raw, _ = compute_gae_advantage_return(rewards, values, mask, gamma=0.99, lam=0.95, whiten=False)
    adv, _ = compute_gae_advantage_return(rewards, values, mask, gamma=0.99, lam=0.95)
    torch.testing.assert_close(adv, masked_whiten(raw, mask), rtol=1e-6, atol=1e-6)
    # two valid tokens, whitened: +-1/sqrt(2) (unbiased variance)
    assert adv[0, 2].item() == pytest.approx(2**-0.5, abs=1e-4)
    assert adv[0, 3].item() == pytest.approx(-(2**-0.5), abs=1e-4)


def _random_case(seed, batch, length, kind):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(batch, length, generator=g)
    values = torch.randn(batch, length, generator=g)
    if kind == "right-padded":
        lengths = torch.randint(0, length + 1, (batch,), generator=g)
        mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    elif kind == "interior":
        mask = (torch.rand(batch, length, generator=g) > 0.35).float()
    else:  # prompt+response layout: leading zeros, a block of ones, trailing zeros
        start = torch.randint(0, length, (batch,), generator=g)
        end = torch.randint(0, length + 1, (batch,), generator=g)
        pos = torch.arange(length)[None, :]
        mask = ((pos >= start[:, None]) & (pos < end[:, None])).float()
    mask[0] = 0.0  # an all-zero row
    if batch > 2:
        mask[1] = 1.0  # a full row
    return rewards, values, mask


def _assert_relative(actual, expected, rtol=1e-5):
    """Elementwise |a - e| <= rtol * |e| (plus a floor far below fp32 resolution)."""
    diff = (actual.double() - expected).abs()
    bound = rtol * expected.abs() + 1e-30
    worst = (diff / (expected.abs() + 1e-30)).max().item()
    assert bool((diff <= bound).all()), f"max relative error {worst:.3e}"


CASES = [
    (0.99, 0.95, 64, 37, "interior"),
    (1.0, 1.0, 64, 37, "interior"),
    (0.99, 0.95, 8, 4096, "interior"),
    (1.0, 1.0, 8, 4096, "interior"),
    (0.99, 0.95, 8, 4096, "right-padded"),
    (1.0, 1.0, 8, 4096, "right-padded"),
    (0.99, 0.95, 32, 300, "block"),
    (1.0, 1.0, 32, 300, "right-padded"),
    (0.5, 0.3, 8, 4096, "interior"),  # gamma*lam = 0.15: the scan runs in several blocks
    (0.9, 0.0, 32, 200, "interior"),  # lam = 0: one-step TD
    (0.0, 0.9, 32, 200, "right-padded"),  # gamma = 0
    (1.0, 1.0, 1, 1, "interior"),
]


@pytest.mark.parametrize("gamma,lam,batch,length,kind", CASES)
def test_matches_per_step_recurrence(gamma, lam, batch, length, kind):
    """Raw advantages (every position, masked ones included: verl's carry), returns, and the
    whitened advantages, all within a relative 1e-5 of the float64 recurrence."""
    rewards, values, mask = _random_case(batch * 1000 + length, batch, length, kind)
    ref_adv, ref_returns = gae_recurrence(rewards, values, mask, gamma, lam)
    adv, returns = compute_gae_advantage_return(
        rewards, values, mask, gamma=gamma, lam=lam, whiten=False
    )
    assert adv.dtype == torch.float32 and returns.dtype == torch.float32
    _assert_relative(adv, ref_adv)
    _assert_relative(returns, ref_returns)
    if mask.sum() > 1:
        whitened, _ = compute_gae_advantage_return(rewards, values, mask, gamma=gamma, lam=lam)
        _assert_relative(whitened, whiten(ref_adv, mask))


def test_float64_inputs_are_not_modified_and_stay_float64():
    rewards, values, mask = _random_case(3, 8, 50, "interior")
    rewards, values = rewards.double(), values.double()
    r0, v0 = rewards.clone(), values.clone()
    adv, returns = compute_gae_advantage_return(rewards, values, mask, gamma=0.99, lam=0.95)
    assert torch.equal(rewards, r0) and torch.equal(values, v0)
    assert adv.dtype == torch.float64 and returns.dtype == torch.float64


def test_no_nan_for_empty_or_single_token_batches():
    values = torch.randn(3, 5)
    rewards = torch.randn(3, 5)
    adv, returns = compute_gae_advantage_return(rewards, values, torch.zeros(3, 5))
    assert torch.isfinite(adv).all() and torch.isfinite(returns).all()
    mask = torch.zeros(3, 5)
    mask[1, 2] = 1.0
    adv, _ = compute_gae_advantage_return(rewards, values, mask, gamma=1.0, lam=1.0)
    assert torch.isfinite(adv).all() and adv[1, 2].item() == 0.0


def test_registered_as_gae_and_rejects_bad_gamma():
    assert get_adv_estimator("gae") is compute_gae_advantage_return
    x = torch.zeros(1, 3)
    with pytest.raises(ValueError, match="gamma"):
        compute_gae_advantage_return(x, x, x + 1, gamma=1.5, lam=1.0)


hypothesis = pytest.importorskip("hypothesis")
st = pytest.importorskip("hypothesis.strategies")


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(
    mask_rows=st.lists(st.lists(st.booleans(), min_size=12, max_size=12), min_size=1, max_size=5),
    gamma=st.sampled_from([1.0, 0.99, 0.9, 0.5, 0.0]),
    lam=st.sampled_from([1.0, 0.95, 0.5, 0.0]),
    seed=st.integers(0, 2**16),
)
def test_any_mask_matches_recurrence(mask_rows, gamma, lam, seed):
    mask = torch.tensor(mask_rows, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(mask.shape, generator=g)
    values = torch.randn(mask.shape, generator=g)
    adv, returns = compute_gae_advantage_return(
        rewards, values, mask, gamma=gamma, lam=lam, whiten=False
    )
    ref_adv, ref_returns = gae_recurrence(rewards, values, mask, gamma, lam)
    _assert_relative(adv, ref_adv)
    _assert_relative(returns, ref_returns)


@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (1, 1)])
@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.bool, torch.int64])
def test_degenerate_shapes_and_mask_dtypes(shape, mask_dtype):
    rewards, values = torch.randn(shape), torch.randn(shape)
    mask = torch.ones(shape, dtype=mask_dtype)
    adv, returns = compute_gae_advantage_return(rewards, values, mask, gamma=0.9, lam=0.9)
    assert adv.shape == shape and returns.shape == shape
    assert torch.isfinite(adv).all() and torch.isfinite(returns).all()


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.float64])
def test_mask_dtypes_agree(mask_dtype):
    rewards, values, mask = _random_case(5, 16, 40, "interior")
    expected = compute_gae_advantage_return(rewards, values, mask, gamma=0.99, lam=0.95)
    got = compute_gae_advantage_return(rewards, values, mask.to(mask_dtype), gamma=0.99, lam=0.95)
    torch.testing.assert_close(got, expected)
    rewards, values, mask = _random_case(6, 16, 40, "right-padded")
    expected = compute_gae_advantage_return(rewards, values, mask, gamma=0.99, lam=0.95)
    got = compute_gae_advantage_return(rewards, values, mask.to(mask_dtype), gamma=0.99, lam=0.95)
    torch.testing.assert_close(got, expected)
