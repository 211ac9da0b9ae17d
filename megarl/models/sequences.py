"""The batches the runner (:mod:`megarl.models.runner`) takes and gives: right-padded sequences,
per-token actor outputs, their masks, and how a batch is cut into micro-batches. Re-exported by
the runner, where callers import them from."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from megatron.core import parallel_state

MicroBatches = int | Sequence[torch.Tensor]
"""A micro-batch size (equal consecutive slices) or explicit row-index tensors, one per
micro-batch (e.g. formed by a token budget; sizes may differ except under VPP)."""


@dataclass
class SequenceBatch:
    """Right-padded prompt+response sequences and per-sequence tensors for a loss function."""

    input_ids: torch.Tensor
    """``[N, S]`` token ids (identical on every TP/PP rank of a data-parallel replica)."""
    prompt_lengths: torch.Tensor
    """``[N]`` prompt lengths (at least 1)."""
    lengths: torch.Tensor
    """``[N]`` prompt + response lengths."""
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per-sequence tensors ``[N, ...]`` (advantages, old log-probs, ...) sliced per micro-batch."""

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def response_width(self) -> int:
        """R: the longest response."""
        return int((self.lengths - self.prompt_lengths).max().item()) if len(self) else 0


@dataclass
class LogProbs:
    """Per-response-token actor outputs ``[N, R]``, on every rank."""

    log_probs: torch.Tensor
    entropy: torch.Tensor
    sum_pi_squared: torch.Tensor | None = None
    """sum_v pi(v)^2 of each position's distribution (optimal-token-baseline estimators)."""
    routing: torch.Tensor | None = None
    """The experts each token was routed to, ``[N, layers, positions, k]`` of this pipeline
    rank's MoE layers (:mod:`megarl.models.routing`; when recorded)."""
    topk_log_probs: torch.Tensor | None = None
    """``[N, R, k]`` the k largest log-probs at each position, by rank (when asked: a teacher)."""
    topk_ids: torch.Tensor | None = None
    """``[N, R, k]`` int64: their token ids."""


def response_mask(prompt_lengths: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``[N, R]`` bool: True for real response tokens (R = longest response)."""
    resp = lengths - prompt_lengths
    r = int(resp.max().item()) if resp.numel() else 0
    return torch.arange(r, device=lengths.device)[None, :] < resp[:, None]


def causal_mask(seq_len: int, device: torch.device) -> torch.Tensor:
    """Megatron's attention-mask convention: True = masked out. ``[1, 1, S, S]``.

    Right padding needs nothing more than causality: real tokens never attend to the pads that
    follow them, and outputs at pad positions are discarded.
    """
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), 1)[None, None]


def interleaved_multiple(chunks: Sequence[torch.nn.Module]) -> int:
    """What the micro-batch count must be a multiple of: PP under the interleaved (VPP) schedule
    (more than one chunk per rank), else 1."""
    return parallel_state.get_pipeline_model_parallel_world_size() if len(chunks) > 1 else 1


def micro_batching(n: int, limit: int, multiple: int = 1) -> tuple[int, int]:
    """``(padded_n, micro_batch_size)``: the fewest sequences ``>= n`` and the largest micro-batch
    size ``<= limit`` dividing them into a multiple of ``multiple`` micro-batches (Megatron's
    interleaved schedule needs a multiple of PP, see :func:`interleaved_multiple`)."""
    padded = -(-n // multiple) * multiple
    size = max(
        d
        for d in range(1, min(padded, max(limit, 1)) + 1)
        if padded % d == 0 and (padded // d) % multiple == 0
    )
    return padded, size


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with copies of its last row appended up to ``rows`` rows (for
    :func:`micro_batching`'s padding; the padded rows' results are dropped)."""
    extra = rows - t.shape[0]
    return torch.cat([t, t[-1:].expand(extra, *t.shape[1:])]) if extra > 0 else t
