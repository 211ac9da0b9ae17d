"""Loss aggregation (`actor.loss_agg_mode`) that is exact under micro-batching.

Pass `agg_loss` the counts of the whole mini-batch (`global_token_count` / `global_seq_count`:
`count_tokens_and_seqs` summed over micro-batches and all-reduced) and the micro-batch losses add
up to the mini-batch's loss, so K micro-batches give the same gradient as one batch. The runner
turns these shares into exact gradients; that contract is stated in `megarl/models/runner.py`.
"""

from __future__ import annotations

import torch

from megarl.algo.masked import masked_sum

LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def count_tokens_and_seqs(loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Local (valid tokens, sequences with at least one valid token) of a `[B, T]` mask.

    Sum both over every micro-batch of the mini-batch and all-reduce to get the
    `global_token_count` and `global_seq_count` of `agg_loss`. Under context parallelism each
    sequence's tokens are split over the CP ranks: all-reduce the token count over DP x CP but the
    sequence count over DP only (CP ranks share sequences), and give `agg_loss` `seq_token_counts`
    for seq-mean-token-mean so that the per-shard terms add up to each sequence's mean.
    """
    tokens_per_seq = loss_mask.sum(dim=-1)
    return tokens_per_seq.sum(), (tokens_per_seq > 0).sum()


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    global_token_count: torch.Tensor | float | None = None,
    global_seq_count: torch.Tensor | float | None = None,
    loss_scale_factor: float | None = None,
    seq_token_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Aggregate a `[B, T]` per-token loss into a scalar.

    Modes (N_tok, N_seq: the global counts if given, else this batch's; "sequences" are those with
    at least one valid token; l_it: loss of token t of sequence i, summed over valid tokens only):
        token-mean:              sum_it l_it / N_tok
        token-sum:               sum_it l_it                             (no normaliser)
        seq-mean-token-sum:      sum_i (sum_t l_it) / N_seq
        seq-mean-token-mean:     sum_i (sum_t l_it / T_i) / N_seq        (T_i: valid tokens of i)
        seq-mean-token-sum-norm: sum_i (sum_t l_it / loss_scale_factor) / N_seq   (Dr.GRPO)
    `loss_scale_factor` defaults to T (the padded response length); set a constant (e.g. the max
    response length) to keep the normaliser fixed through training. verl 0.9.1 computes the same:
    the mean over sequences of seq-mean-token-sum, divided by loss_scale_factor. token-sum needs
    no count: the micro-batch sums add up to the mini-batch's sum (verl multiplies it by the DP
    size to undo its gradient averaging; the trainer's loss contract owns that scaling here).

    Masked positions never reach the result (not even NaN/inf). With no valid token at all, the
    result is 0 (counts are clamped to at least 1 when computed locally).

    Args:
        loss_mat: `[B, T]` per-token loss.
        loss_mask: `[B, T]` binary mask.
        loss_agg_mode: one of `LOSS_AGG_MODES`.
        global_token_count: N_tok over the whole mini-batch (token-mean).
        global_seq_count: N_seq over the whole mini-batch (seq-mean-* modes).
        loss_scale_factor: divisor for seq-mean-token-sum-norm.
        seq_token_counts: `[B]` valid tokens of each whole sequence (seq-mean-token-mean under
            context parallelism, where loss_mask holds only this rank's shard); default: the
            row sums of loss_mask.

    Returns:
        scalar tensor.
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"unknown loss_agg_mode {loss_agg_mode!r}; valid names: " + ", ".join(LOSS_AGG_MODES)
        )
    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, loss_mask)
    if loss_agg_mode == "token-mean":
        if global_token_count is None:
            global_token_count = loss_mask.sum().clamp(min=1)
        return masked_sum(loss_mat, loss_mask) / global_token_count

    seq_sums = masked_sum(loss_mat, loss_mask, dim=-1)  # [B]
    tokens_per_seq = loss_mask.sum(dim=-1)
    if global_seq_count is None:
        global_seq_count = (tokens_per_seq > 0).sum().clamp(min=1)
    if loss_agg_mode == "seq-mean-token-sum":
        per_seq = seq_sums
    elif loss_agg_mode == "seq-mean-token-mean":
        if seq_token_counts is not None:
            tokens_per_seq = seq_token_counts
        per_seq = seq_sums / tokens_per_seq.to(seq_sums.dtype).clamp(min=1)
    else:  # seq-mean-token-sum-norm
        scale = loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
        per_seq = seq_sums / scale
    return per_seq.sum() / global_seq_count
