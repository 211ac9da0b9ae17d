"""GAE: the seed's worked example, and the vectorized torch code against verl's per-step
recurrence (tests/algo/_reference.py)."""

from __future__ import annotations

import pytest
import torch

from megarl.algo import compute_gae_advantage_return, get_adv_estimator, masked_whiten
from tests.algo._reference import gae_recurrence, whiten

gae = compute_gae_advantage_return


def test_seed_worked_example():
    # seeds/003 §2.5: T=4 (2 prompt + 2 response tokens), reward 1.0 on the last token.
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[0.2, 0.3, 0.4, 0.5]])
    mask = torch.tensor([[0.0, 0.0, 1.0, 1.0]])
    adv, returns = gae(rewards, values, mask, gamma=0.99, lam=0.95, whiten=False)
    # delta_3 = 1 - 0.5 = 0.5, A_3 = 0.5; delta_2 = 0.99*0.5 - 0.4 = 0.095, A_2 = 0.095 + 0.9405*0.5
    assert round(adv[0, 2].item(), 3) == 0.565 and round(adv[0, 3].item(), 3) == 0.5
    assert adv[0, 2].item() == pytest.approx(0.095 + 0.9405 * 0.5, rel=1e-6)
    # Masked positions hold 0 as in the seed; returns = advantages + values everywhere.
    assert adv[0, :2].tolist() == [0.0, 0.0]
    assert torch.equal(returns, adv + values)


def test_seed_example_whitened_over_valid_tokens():
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[0.2, 0.3, 0.4, 0.5]])
    mask = torch.tensor([[0.0, 0.0, 1.0, 1.0]])
    raw, _ = gae(rewards, values, mask, gamma=0.99, lam=0.95, whiten=False)
    adv, _ = gae(rewards, values, mask, gamma=0.99, lam=0.95)
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
    """Elementwise |a - e| <= rtol * |e| (plus a floor far below float32 resolution)."""
    diff = (actual.double() - expected).abs()
    bound = rtol * expected.abs() + 1e-30
    worst = (diff / (expected.abs() + 1e-30)).max().item()
    assert bool((diff <= bound).all()), f"max relative error {worst:.3e}"


def _assert_matches_recurrence(rewards, values, mask, gamma, lam):
    """Valid positions within a relative 1e-5 of verl's float64 recurrence (advantages, returns
    and whitened advantages); masked positions: advantage 0, returns = values."""
    ref_adv, ref_returns = gae_recurrence(rewards, values, mask, gamma, lam)
    valid = mask.bool()
    ref_adv = torch.where(valid, ref_adv, 0.0)
    ref_returns = torch.where(valid, ref_returns, values.double())
    adv, returns = gae(rewards, values, mask, gamma=gamma, lam=lam, whiten=False)
    assert adv.dtype == values.dtype and returns.dtype == values.dtype
    _assert_relative(adv, ref_adv)
    _assert_relative(returns, ref_returns)
    assert torch.equal(adv[~valid], torch.zeros_like(adv[~valid]))
    assert torch.equal(returns[~valid], values[~valid])
    if mask.sum() > 1:
        whitened, _ = gae(rewards, values, mask, gamma=gamma, lam=lam)
        _assert_relative(whitened, whiten(ref_adv, mask))


# (gamma, lam, batch, length, mask kind). The vectorized code cuts rows into blocks of at most
# 64x weight range: gamma*lam = 0.9405 gives 64-step blocks joined by a matrix product
# (right-padded) or a weighted sum (other masks); 0.15 gives 2-step blocks, too many to join
# directly (doubling); lam < 0.01 and gamma = 0 take the direct route; 300 steps pad a block.
CASES = [
    (0.99, 0.95, 64, 37, "interior"),
    (1.0, 1.0, 64, 37, "interior"),
    (0.99, 0.95, 8, 4096, "interior"),
    (1.0, 1.0, 8, 4096, "interior"),
    (0.99, 0.95, 8, 4096, "right-padded"),
    (1.0, 1.0, 8, 4096, "right-padded"),
    (0.99, 0.95, 32, 300, "block"),
    (1.0, 1.0, 32, 300, "right-padded"),
    (0.5, 0.3, 8, 4096, "interior"),
    (0.3, 0.5, 16, 1000, "right-padded"),
    (0.999, 0.9999, 4, 20000, "right-padded"),
    (0.9, 0.005, 32, 200, "interior"),
    (0.9, 0.0, 32, 200, "interior"),  # lam = 0: one-step TD
    (0.0, 0.9, 32, 200, "right-padded"),  # gamma = 0
    (1.0, 1.0, 1, 1, "interior"),
]


@pytest.mark.parametrize("gamma,lam,batch,length,kind", CASES)
def test_matches_per_step_recurrence(gamma, lam, batch, length, kind):
    rewards, values, mask = _random_case(batch * 1000 + length, batch, length, kind)
    _assert_matches_recurrence(rewards, values, mask, gamma, lam)


def test_batches_larger_than_one_chunk():
    # 300 rows of 4096 steps: several chunks of rows
    rewards, values, mask = _random_case(17, 300, 4096, "right-padded")
    _assert_matches_recurrence(rewards, values, mask, 0.99, 0.95)


def test_float64_inputs_are_not_modified_and_stay_float64():
    rewards, values, mask = _random_case(3, 8, 50, "interior")
    rewards, values = rewards.double(), values.double()
    r0, v0, m0 = rewards.clone(), values.clone(), mask.clone()
    adv, returns = gae(rewards, values, mask, gamma=0.99, lam=0.95)
    assert torch.equal(rewards, r0) and torch.equal(values, v0) and torch.equal(mask, m0)
    assert adv.dtype == torch.float64 and returns.dtype == torch.float64


def test_strided_and_bfloat16_inputs():
    rewards, values, mask = _random_case(4, 16, 80, "interior")
    expected = gae(rewards, values, mask, gamma=0.99, lam=0.95)
    strided = [torch.stack([x, -x], dim=-1)[..., 0] for x in (rewards, values, mask)]
    assert not strided[0].is_contiguous()
    torch.testing.assert_close(gae(*strided, gamma=0.99, lam=0.95), expected)
    half = gae(rewards.bfloat16(), values.bfloat16(), mask, gamma=0.99, lam=0.95)
    assert half[0].dtype == torch.bfloat16
    reference = gae(rewards.bfloat16().float(), values.bfloat16().float(), mask, 0.99, 0.95)
    torch.testing.assert_close(half[1], reference[1].bfloat16())


def test_no_nan_for_empty_or_single_token_batches():
    values = torch.randn(3, 5)
    rewards = torch.randn(3, 5)
    adv, returns = gae(rewards, values, torch.zeros(3, 5))
    assert torch.isfinite(adv).all() and torch.isfinite(returns).all()
    mask = torch.zeros(3, 5)
    mask[1, 2] = 1.0
    adv, _ = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert torch.isfinite(adv).all() and adv[1, 2].item() == 0.0


def test_rejects_bad_arguments():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="gamma"):
        gae(x, x, x + 1, gamma=1.5, lam=1.0)
    with pytest.raises(ValueError, match="lam"):
        gae(x, x, x + 1, gamma=1.0, lam=-0.1)
    with pytest.raises(ValueError, match="one shape"):
        gae(x, torch.zeros(2, 4), x)
    with pytest.raises(ValueError, match="binary"):
        gae(x, x, torch.full((2, 3), 0.5), gamma=0.99, lam=0.95)
    with pytest.raises(ValueError, match="binary"):
        gae(x, x, torch.full((2, 3), 2, dtype=torch.int64), gamma=0.9, lam=0.0)
    with pytest.raises(ValueError, match="binary"):  # the chunked route checks each chunk
        gae(x, x, torch.full((2, 3), 2, dtype=torch.int64), gamma=0.9, lam=0.9)


def test_registered_as_gae():
    assert get_adv_estimator("gae") is compute_gae_advantage_return


hypothesis = pytest.importorskip("hypothesis")
st = pytest.importorskip("hypothesis.strategies")


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(
    mask_rows=st.lists(st.lists(st.booleans(), min_size=12, max_size=12), min_size=1, max_size=5),
    gamma=st.sampled_from([1.0, 0.99, 0.9, 0.5, 0.0]),
    lam=st.sampled_from([1.0, 0.95, 0.5, 0.005, 0.0]),
    seed=st.integers(0, 2**16),
)
def test_any_mask_matches_recurrence(mask_rows, gamma, lam, seed):
    mask = torch.tensor(mask_rows, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(mask.shape, generator=g)
    values = torch.randn(mask.shape, generator=g)
    _assert_matches_recurrence(rewards, values, mask, gamma, lam)


@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (1, 1)])
@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.bool, torch.int64])
def test_degenerate_shapes_and_mask_dtypes(shape, mask_dtype):
    rewards, values = torch.randn(shape), torch.randn(shape)
    mask = torch.ones(shape, dtype=mask_dtype)
    adv, returns = gae(rewards, values, mask, gamma=0.9, lam=0.9)
    assert adv.shape == shape and returns.shape == shape
    assert torch.isfinite(adv).all() and torch.isfinite(returns).all()


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.float64])
def test_mask_dtypes_agree(mask_dtype):
    for seed, kind in ((5, "interior"), (6, "right-padded")):
        rewards, values, mask = _random_case(seed, 16, 40, kind)
        expected = gae(rewards, values, mask, gamma=0.99, lam=0.95)
        got = gae(rewards, values, mask.to(mask_dtype), gamma=0.99, lam=0.95)
        torch.testing.assert_close(got, expected)
