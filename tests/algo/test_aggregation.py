"""Loss aggregation modes on a hand-made batch, and exactness under micro-batching / DP."""

from __future__ import annotations

import pytest
import torch

from megarl.algo import LOSS_AGG_MODES, agg_loss, compute_policy_loss_vanilla, count_tokens_and_seqs

LOSS = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 0.0, 9.0], [7.0, 8.0, 9.0, 10.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])


def test_hand_made_batch_every_mode():
    # valid tokens: row 0 -> 1, 2, 3 (sum 6, mean 2); row 1 -> 5, 6 (sum 11, mean 5.5); row 2 empty
    assert agg_loss(LOSS, MASK, "token-mean").item() == pytest.approx(17 / 5)
    assert agg_loss(LOSS, MASK, "token-sum").item() == pytest.approx(17)
    # global counts do not change a sum
    assert agg_loss(LOSS, MASK, "token-sum", global_token_count=10).item() == pytest.approx(17)
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum").item() == pytest.approx((6 + 11) / 2)
    assert agg_loss(LOSS, MASK, "seq-mean-token-mean").item() == pytest.approx((2 + 5.5) / 2)
    # Dr.GRPO: token sums over a constant (default: T = 4), averaged over sequences
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum-norm").item() == pytest.approx((6 + 11) / 4 / 2)
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", loss_scale_factor=10).item() == (
        pytest.approx((0.6 + 1.1) / 2)
    )


def test_global_counts_replace_local_ones():
    assert agg_loss(LOSS, MASK, "token-mean", global_token_count=10).item() == pytest.approx(1.7)
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum", global_seq_count=4).item() == pytest.approx(
        17 / 4
    )
    tokens, seqs = count_tokens_and_seqs(MASK)
    assert tokens.item() == 5 and seqs.item() == 2


def test_nan_in_masked_positions_and_empty_mask():
    loss = LOSS.clone()
    loss[2, 0] = float("nan")
    loss[0, 3] = float("inf")
    for mode in LOSS_AGG_MODES:
        assert torch.isfinite(agg_loss(loss, MASK, mode))
        assert agg_loss(loss, torch.zeros_like(MASK), mode).item() == 0.0


def test_unknown_mode_lists_valid_names():
    with pytest.raises(ValueError) as err:
        agg_loss(LOSS, MASK, "seq-sum")
    for mode in LOSS_AGG_MODES:
        assert mode in str(err.value)


def _batch(seed, batch=12, length=9):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, length + 1, (batch,), generator=g)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    mask[3, 2] = 0.0  # an interior zero
    old = -torch.rand(batch, length, generator=g) * 2
    log_prob = (old + 0.2 * torch.randn(batch, length, generator=g)).requires_grad_(True)
    adv = torch.randn(batch, length, generator=g)
    return old, log_prob, adv, mask


def _loss(old, log_prob, adv, mask, mode, **counts):
    loss, _ = compute_policy_loss_vanilla(
        old,
        log_prob,
        adv,
        mask,
        clip_ratio=0.2,
        loss_agg_mode=mode,
        loss_scale_factor=7.0,
        **counts,
    )
    return loss


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("splits", [[12], [6, 6], [5, 1, 4, 2], [1] * 12])
def test_micro_batches_give_the_full_batch_gradient(mode, splits):
    old, log_prob, adv, mask = _batch(1)
    full = _loss(old, log_prob, adv, mask, mode)
    (full_grad,) = torch.autograd.grad(full, log_prob)

    tokens, seqs = count_tokens_and_seqs(mask)  # the trainer sums these over micro-batches/ranks
    total = torch.zeros(())
    grad = torch.zeros_like(log_prob)
    start = 0
    for size in splits:
        rows = slice(start, start + size)
        start += size
        micro = log_prob.detach()[rows].clone().requires_grad_(True)
        loss = _loss(
            old[rows],
            micro,
            adv[rows],
            mask[rows],
            mode,
            global_token_count=tokens,
            global_seq_count=seqs,
        )
        loss.backward()
        grad[rows] += micro.grad
        total = total + loss.detach()
    torch.testing.assert_close(total, full.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, full_grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_megatron_scaling_with_data_parallel_ranks(mode):
    """Each of 2 DP ranks runs 3 micro-batches; Megatron divides each micro-batch loss by the
    number of micro-batches and DDP averages over ranks. Scaling by num_microbatches * dp_size (as
    aggregation.py documents) gives the full-batch gradient."""
    old, log_prob, adv, mask = _batch(2, batch=12)
    full = _loss(old, log_prob, adv, mask, mode)
    (full_grad,) = torch.autograd.grad(full, log_prob)

    dp_size, num_micro = 2, 3
    tokens, seqs = count_tokens_and_seqs(mask)  # all-reduced over ranks in the trainer
    rank_grads = []
    for rank in range(dp_size):
        grad = torch.zeros_like(log_prob)
        for micro in range(num_micro):
            rows = slice(rank * 6 + micro * 2, rank * 6 + micro * 2 + 2)
            lp = log_prob.detach()[rows].clone().requires_grad_(True)
            loss = _loss(
                old[rows],
                lp,
                adv[rows],
                mask[rows],
                mode,
                global_token_count=tokens,
                global_seq_count=seqs,
            )
            returned_to_megatron = loss * num_micro * dp_size
            (returned_to_megatron / num_micro).backward()  # what the pipeline schedule does
            grad[rows] += lp.grad
        rank_grads.append(grad)
    ddp_grad = sum(rank_grads) / dp_size  # DDP gradient averaging
    torch.testing.assert_close(ddp_grad, full_grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_context_parallel_shards_add_up(mode):
    """Two CP ranks hold the first and second half of every sequence's tokens. With the token
    count over both shards, the sequence count once, and per-sequence token counts of the whole
    sequences, the shard losses add up to the unsharded loss."""
    old, log_prob, adv, mask = _batch(3, batch=6, length=10)
    full = _loss(old, log_prob, adv, mask, mode).detach()
    tokens, seqs = count_tokens_and_seqs(mask)
    seq_tokens = mask.sum(-1)
    total = torch.zeros(())
    for cols in (slice(0, 5), slice(5, 10)):
        total = total + _loss(
            old[:, cols],
            log_prob.detach()[:, cols],
            adv[:, cols],
            mask[:, cols],
            mode,
            global_token_count=tokens,
            global_seq_count=seqs,
            seq_token_counts=seq_tokens,
        )
    # (seq-mean-token-sum-norm: _loss fixes loss_scale_factor, the default T would be the shard's)
    torch.testing.assert_close(total, full, rtol=1e-6, atol=1e-6)
