"""The student's log-probs at given token ids (the teacher's top-k) from vocab-parallel logits.

On-policy distillation's ``forward_kl_topk`` needs log softmax(z)_v at the teacher's k ids of
every position, over the student's full vocabulary, which TP shards. As in
:mod:`megarl.models.logprobs`, each rank reduces three per-position quantities over the TP group
(the max, the sum of exponentials, and the logits at those of the k ids its shard holds) and never
gathers the vocabulary; padded columns are -inf. The backward pass needs no communication: with
G the gradient of the `[B, T, K]` output (the same on every rank),
dL/dz_j = (sum_k G_k 1[id_k = j] - p_j sum_k G_k) / temperature on each rank's own columns.
The loss itself is :func:`megarl.algo.distillation.forward_kl_topk` (pure).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megarl.models.logprobs import DEFAULT_CHUNK, _all_reduce, _scaled_masked


class _VocabParallelLogProbsAt(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        logits: torch.Tensor,
        ids: torch.Tensor,
        temperature: float,
        vocab_start: int,
        vocab_size: int,
        group: dist.ProcessGroup | None,
        chunk: int,
    ) -> torch.Tensor:
        seq, local_vocab = logits.shape[1], logits.shape[-1]
        dtype = torch.promote_types(logits.dtype, torch.float32)
        stats_max = torch.empty(logits.shape[:-1], dtype=dtype, device=logits.device)
        sum_exp = torch.empty_like(stats_max)
        ids_z = torch.zeros(ids.shape, dtype=dtype, device=logits.device)
        local = ids - vocab_start
        in_shard = (local >= 0) & (local < local_vocab)
        safe = torch.where(in_shard, local, torch.zeros_like(local))
        for s in range(0, seq, chunk):
            z = _scaled_masked(logits[:, s : s + chunk], temperature, vocab_start, vocab_size)
            stats_max[:, s : s + chunk] = z.max(dim=-1).values
            picked = z.gather(-1, safe[:, s : s + chunk])
            ids_z[:, s : s + chunk] = torch.where(in_shard[:, s : s + chunk], picked, 0.0)
        _all_reduce(stats_max, dist.ReduceOp.MAX, group)
        for s in range(0, seq, chunk):
            z = _scaled_masked(logits[:, s : s + chunk], temperature, vocab_start, vocab_size)
            sum_exp[:, s : s + chunk] = (z - stats_max[:, s : s + chunk, None]).exp().sum(-1)
        _all_reduce(sum_exp, dist.ReduceOp.SUM, group)
        _all_reduce(ids_z, dist.ReduceOp.SUM, group)  # each id lies in exactly one shard
        log_z = stats_max + sum_exp.log()  # [B, T]
        ctx.save_for_backward(logits, safe, in_shard, log_z)
        ctx.params = (temperature, vocab_start, vocab_size, chunk)
        return ids_z - log_z[..., None]

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        logits, safe, in_shard, log_z = ctx.saved_tensors
        temperature, vocab_start, vocab_size, chunk = ctx.params
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[1], chunk):
            sl = slice(s, s + chunk)
            z = _scaled_masked(logits[:, sl], temperature, vocab_start, vocab_size)
            p = (z - log_z[:, sl, None]).exp()
            g_out = grad_out[:, sl].to(p.dtype)
            g = -p * g_out.sum(-1, keepdim=True)
            # repeated ids (and the dummy column of out-of-shard ones, zeroed) accumulate
            g.scatter_add_(-1, safe[:, sl], g_out * in_shard[:, sl])
            grad[:, sl] = (g / temperature).to(grad.dtype)
        return grad, None, None, None, None, None, None


def vocab_parallel_log_probs_at(
    logits: torch.Tensor,
    ids: torch.Tensor,
    *,
    vocab_size: int,
    temperature: float = 1.0,
    vocab_start: int = 0,
    group: dist.ProcessGroup | None = None,
    chunk: int = DEFAULT_CHUNK,
) -> torch.Tensor:
    """log softmax(logits / temperature) at ``ids``, over the full (TP-sharded) vocabulary.

    Args:
        logits: ``[B, T, V_local]`` this TP rank's slice of the (padded) vocabulary, starting at
            global column ``vocab_start``.
        ids: ``[B, T, K]`` global token ids (the teacher's top-k), each below ``vocab_size``.
        vocab_size: the true vocabulary size; columns at or past it are padding, masked out.
        group: the TP process group (None or size 1: no communication).
        chunk: positions processed at once (bounds the extra memory to one ``[B, chunk, V/TP]``).

    Returns:
        ``[B, T, K]`` in at least fp32, identical on every TP rank, differentiable with respect
        to ``logits``.
    """
    if logits.dim() != 3 or ids.dim() != 3 or ids.shape[:2] != logits.shape[:2]:
        raise ValueError(
            f"logits must be [B, T, V] and ids [B, T, K]; got {tuple(logits.shape)} and "
            f"{tuple(ids.shape)}"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return _VocabParallelLogProbsAt.apply(
        logits, ids.long(), float(temperature), vocab_start, vocab_size, group, chunk
    )


def vocab_parallel_topk_log_probs(
    logits: torch.Tensor,
    k: int,
    *,
    vocab_size: int,
    temperature: float = 1.0,
    vocab_start: int = 0,
    group: dist.ProcessGroup | None = None,
    chunk: int = DEFAULT_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A frozen teacher's top-k: the ``k`` largest of log softmax(logits / temperature) over the
    full (TP-sharded) vocabulary at every position, and their global ids (no gradient).

    Each rank takes the top-k of its own shard (padding columns masked), the candidates of every
    TP rank are all-gathered (``k`` per rank and position, never the vocabulary) and the top-k
    of those is the answer; log Z comes from the max and sum-of-exponentials reductions.

    Args:
        logits: ``[B, T, V_local]`` this TP rank's slice of the (padded) vocabulary, starting at
            global column ``vocab_start``.
        k: how many, at most the true vocabulary size.

    Returns:
        ``(values, ids)``, each ``[B, T, k]``, by rank (largest first): log-probs in at least
        fp32 and int64 ids, identical on every TP rank.
    """
    if not 1 <= k <= vocab_size:
        raise ValueError(f"top-k must be in 1..vocab_size={vocab_size}, got {k}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    size = dist.get_world_size(group) if group is not None else 1
    seq, local_vocab = logits.shape[1], logits.shape[-1]
    local_k = min(k, local_vocab)
    dtype = torch.promote_types(logits.dtype, torch.float32)
    with torch.no_grad():
        stats_max = torch.empty(logits.shape[:-1], dtype=dtype, device=logits.device)
        sum_exp = torch.empty_like(stats_max)
        values = torch.empty((*logits.shape[:-1], local_k), dtype=dtype, device=logits.device)
        ids = torch.empty(values.shape, dtype=torch.int64, device=logits.device)
        for s in range(0, seq, chunk):
            z = _scaled_masked(logits[:, s : s + chunk], temperature, vocab_start, vocab_size)
            stats_max[:, s : s + chunk] = z.max(dim=-1).values
            top = z.topk(local_k, dim=-1)
            values[:, s : s + chunk], ids[:, s : s + chunk] = top.values, top.indices + vocab_start
        _all_reduce(stats_max, dist.ReduceOp.MAX, group)
        for s in range(0, seq, chunk):
            z = _scaled_masked(logits[:, s : s + chunk], temperature, vocab_start, vocab_size)
            sum_exp[:, s : s + chunk] = (z - stats_max[:, s : s + chunk, None]).exp().sum(-1)
        _all_reduce(sum_exp, dist.ReduceOp.SUM, group)
        if size > 1:  # every rank's candidates, then the top-k of them
            parts = [torch.empty_like(values) for _ in range(size)]
            dist.all_gather(parts, values.contiguous(), group=group)
            id_parts = [torch.empty_like(ids) for _ in range(size)]
            dist.all_gather(id_parts, ids.contiguous(), group=group)
            values, ids = torch.cat(parts, dim=-1), torch.cat(id_parts, dim=-1)
        top = values.topk(k, dim=-1)
        log_z = stats_max + sum_exp.log()
        return top.values - log_z[..., None], ids.gather(-1, top.indices)
