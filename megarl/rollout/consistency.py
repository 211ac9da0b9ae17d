"""Run-time check that rollout and training agree: vLLM's log-probs versus the actor's own.

After a weight sync, vLLM's processed log-probs of the tokens it sampled must equal the actor's
``log_softmax(logits / T)`` at those tokens up to kernel round-off (~1e-5 in fp32, ~1e-2 in
bf16). A broken sync (stale weights, a wrong layout, a stale prefix cache) shows up as a jump in
``rollout/logprob_diff_mean`` / ``rollout/logprob_diff_max``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from megarl.rollout.base import RolloutBatch

__all__ = [
    "DIFF_MAX",
    "DIFF_MEAN",
    "batch_sequences",
    "logprob_diff_metrics",
    "rollout_logprob_consistency",
]

DIFF_MEAN = "rollout/logprob_diff_mean"
DIFF_MAX = "rollout/logprob_diff_max"


def logprob_diff_metrics(
    rollout_logprobs: Tensor, actor_logprobs: Tensor, mask: Tensor
) -> dict[str, float]:
    """Mean and max of ``|rollout - actor|`` over real response tokens.

    Args:
        rollout_logprobs, actor_logprobs: ``[N, R]`` response-aligned log-probs.
        mask: ``[N, R]`` bool, True on real response tokens.

    Returns ``{DIFF_MEAN, DIFF_MAX}`` (both 0.0 when there is no token).
    """
    if rollout_logprobs.shape != actor_logprobs.shape or mask.shape != actor_logprobs.shape:
        raise ValueError(
            f"shapes differ: rollout {tuple(rollout_logprobs.shape)}, actor "
            f"{tuple(actor_logprobs.shape)}, mask {tuple(mask.shape)}"
        )
    diff = (rollout_logprobs.double() - actor_logprobs.double()).abs()[mask.bool()]
    if diff.numel() == 0:
        return {DIFF_MEAN: 0.0, DIFF_MAX: 0.0}
    return {DIFF_MEAN: float(diff.mean()), DIFF_MAX: float(diff.max())}


def batch_sequences(
    batch: RolloutBatch, pad_token_id: int = 0
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The runner's inputs for a rollout batch, and vLLM's log-probs aligned with its outputs.

    Returns ``input_ids [N, S]`` (prompt + response, right-padded), ``prompt_lengths [N]``,
    ``lengths [N]``, ``rollout_logprobs [N, R]`` and ``mask [N, R]`` (R = longest response).
    """
    n = len(batch)
    seqs = [s.prompt_token_ids + s.response_token_ids for s in batch]
    width = max([len(s) for s in seqs] + [1])
    input_ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    for i, seq in enumerate(seqs):
        input_ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    prompt_lengths = torch.tensor([len(s.prompt_token_ids) for s in batch], dtype=torch.long)
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    _, logprobs, mask = batch.padded_responses(pad_token_id)
    return input_ids, prompt_lengths, lengths, logprobs, mask


def rollout_logprob_consistency(
    chunks: Sequence[torch.nn.Module],
    batch: RolloutBatch,
    *,
    vocab_size: int,
    temperature: float,
    micro_batch_size: int = 8,
    pad_token_id: int = 0,
) -> dict[str, float]:
    """Recompute ``batch``'s log-probs with the actor and compare them with vLLM's.

    Collective like the runner: the TP/PP peers of a DP replica must pass the same ``batch``.
    The micro-batch size is lowered to fit the batch, and with VPP the batch is padded (with
    copies of its last sequence, results dropped) to a multiple of PP micro-batches. Returns the
    metrics of :func:`logprob_diff_metrics` for this rank's batch (reduce over DP as for any
    other metric).
    """
    from megarl.models.runner import (
        SequenceBatch,
        compute_log_probs,
        interleaved_multiple,
        micro_batching,
        pad_rows,
    )

    if len(batch) == 0 or all(not s.response_token_ids for s in batch):
        return {DIFF_MEAN: 0.0, DIFF_MAX: 0.0}
    input_ids, prompt_lengths, lengths, rollout_lp, mask = batch_sequences(batch, pad_token_id)
    n = len(batch)
    padded, size = micro_batching(n, micro_batch_size, interleaved_multiple(chunks))
    input_ids, prompt_lengths, lengths = (
        pad_rows(t, padded) for t in (input_ids, prompt_lengths, lengths)
    )
    result = compute_log_probs(
        chunks,
        SequenceBatch(input_ids, prompt_lengths, lengths),
        vocab_size=vocab_size,
        micro_batches=size,
        temperature=temperature,
    )
    actor_lp = result.log_probs[:n].float().cpu()
    return logprob_diff_metrics(rollout_lp, actor_lp, mask)
