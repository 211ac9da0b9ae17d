"""Token log-probs and entropy from vocab-parallel (TP-sharded) logits, never gathering the vocab.

Each TP rank holds logits for a contiguous slice of the padded vocabulary; the softmax needs only
three per-position scalars reduced over the TP group (the max, the sum of exponentials and, for
entropy, the sum of ``exp · logit``). Padded vocabulary columns are never read (the
sum-of-squares helper masks them to ``-inf``).
The backward pass recomputes the softmax chunk by chunk over the sequence, so the extra memory
is one ``[B, chunk, V/TP]`` chunk, not a copy of the logits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

DEFAULT_CHUNK = 1024


def _all_reduce(t: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)


def _scaled_masked(
    logits: torch.Tensor, temperature: float, vocab_start: int, vocab_size: int
) -> torch.Tensor:
    """logits / T in at least fp32 (float64 stays float64) with columns at or beyond
    ``vocab_size`` (padding) set to -inf."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    local_vocab = z.shape[-1]
    valid = vocab_size - vocab_start
    if valid < local_vocab:
        z[..., max(valid, 0) :] = float("-inf")
    return z


def _valid_columns(local_vocab: int, vocab_start: int, vocab_size: int) -> int:
    """How many of this shard's leading columns are real vocabulary (the rest is padding)."""
    return min(max(vocab_size - vocab_start, 0), local_vocab)


def _scaled(logits: torch.Tensor, temperature: float, valid: int) -> torch.Tensor:
    """logits / T of the ``valid`` leading columns, in at least fp32 (float64 stays float64):
    a view of ``logits`` when neither changes anything (fp32 at T = 1), so never written to."""
    z = logits[..., :valid]
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    return z if temperature == 1.0 else z / temperature


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    """One pass over each chunk of the logits forward (its max, sum of exponentials and sum of
    ``exp · (z - max)`` against the shard's own max, combined over the TP group in one
    rescaling step), two elementwise passes backward; padded columns are never read."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        logits: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        vocab_start: int,
        vocab_size: int,
        group: dist.ProcessGroup | None,
        chunk: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        seq, local_vocab = logits.shape[1], logits.shape[-1]
        valid = _valid_columns(local_vocab, vocab_start, vocab_size)
        dtype = torch.promote_types(logits.dtype, torch.float32)  # float64 stays float64
        # This shard's max m, sum_j e_j and sum_j e_j (z_j - m), e_j = exp(z_j - m); the
        # target's z where this shard holds it. A shard of padding only: m = -inf, sums 0.
        local_max = torch.full(logits.shape[:-1], float("-inf"), dtype=dtype, device=logits.device)
        sum_exp, sum_exp_z, target_z = (torch.zeros_like(local_max) for _ in range(3))
        local_t = targets - vocab_start
        in_shard = (local_t >= 0) & (local_t < valid)
        safe_t = torch.where(in_shard, local_t, torch.zeros_like(local_t))
        for s in range(0, seq, chunk) if valid else ():
            sl = slice(s, s + chunk)
            z = _scaled(logits[:, sl], temperature, valid)
            m = z.amax(dim=-1)
            shifted = z - m[..., None]
            e = shifted.exp()
            local_max[:, sl], sum_exp[:, sl] = m, e.sum(-1)
            sum_exp_z[:, sl] = e.mul_(shifted).sum(-1)
            tz = z.gather(-1, safe_t[:, sl, None]).squeeze(-1)
            target_z[:, sl] = torch.where(in_shard[:, sl], tz, 0.0)
        stats_max = local_max
        if group is not None and dist.get_world_size(group) > 1:
            # Against the global max M: e^(m - M) rescales the sums; sum e^(z - M) (z - M) =
            # e^(m - M) (sum e (z - m) + (m - M) sum e). One all-reduce for the three sums.
            stats_max = local_max.clone()
            dist.all_reduce(stats_max, op=dist.ReduceOp.MAX, group=group)
            held = sum_exp > 0
            gap = torch.where(held, local_max - stats_max, 0.0)
            scale = torch.where(held, gap.exp(), 0.0)
            sums = torch.stack([sum_exp * scale, (sum_exp_z + gap * sum_exp) * scale, target_z])
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
            sum_exp, sum_exp_z, target_z = sums.unbind(0)
        log_z = sum_exp.log()
        log_probs = target_z - stats_max - log_z
        entropy = log_z - sum_exp_z / sum_exp
        ctx.save_for_backward(logits, safe_t, in_shard, stats_max, log_z, entropy)
        ctx.params = (temperature, valid, chunk)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, grad_ent: torch.Tensor):  # type: ignore[override]
        logits, safe_t, in_shard, stats_max, log_z, entropy = ctx.saved_tensors
        temperature, valid, chunk = ctx.params
        grad = torch.empty_like(logits)
        grad[..., valid:] = 0.0  # padded columns
        # d logp_t / dz_j = 1[j = t] - p_j ;  d H / dz_j = -p_j (log p_j + H), all over T:
        # dz_j = -p_j (g_lp + g_H (log p_j + H)) / T, plus g_lp / T at the target.
        at_target = torch.where(in_shard, grad_logp, 0.0) / temperature
        for s in range(0, logits.shape[1], chunk) if valid else ():
            sl = slice(s, s + chunk)
            log_p = _scaled(logits[:, sl], temperature, valid) - stats_max[:, sl, None]
            log_p.sub_(log_z[:, sl, None])
            p = log_p.exp()
            g = log_p.add_(entropy[:, sl, None]).mul_(grad_ent[:, sl, None])
            g.add_(grad_logp[:, sl, None]).mul_(p).div_(-temperature)
            g.scatter_add_(-1, safe_t[:, sl, None], at_target[:, sl, None].to(g.dtype))
            grad[:, sl, :valid] = g
        return grad, None, None, None, None, None, None


def vocab_parallel_log_probs_and_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_size: int,
    temperature: float = 1.0,
    vocab_start: int = 0,
    group: dist.ProcessGroup | None = None,
    chunk: int = DEFAULT_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of ``targets`` and entropy under ``softmax(logits / temperature)``.

    Args:
        logits: ``[B, T, V_local]`` this TP rank's slice of the (padded) vocabulary, starting at
            global column ``vocab_start``.
        targets: ``[B, T]`` global token ids (each lies in exactly one rank's slice).
        vocab_size: the true vocabulary size; columns at or past it are padding and masked out.
        group: the TP process group (None or size 1: no communication).
        chunk: positions processed at once (bounds the extra memory).

    Returns:
        ``(log_probs, entropy)``, each ``[B, T]`` fp32, identical on every TP rank, both
        differentiable with respect to ``logits``.
    """
    if logits.dim() != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(
            f"logits must be [B, T, V] and targets [B, T]; got {tuple(logits.shape)} and "
            f"{tuple(targets.shape)}"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return _VocabParallelLogProbEntropy.apply(
        logits, targets.long(), float(temperature), vocab_start, vocab_size, group, chunk
    )


@torch.no_grad()
def vocab_parallel_sum_pi_squared(
    logits: torch.Tensor,
    *,
    vocab_size: int,
    temperature: float = 1.0,
    vocab_start: int = 0,
    group: dist.ProcessGroup | None = None,
    chunk: int = DEFAULT_CHUNK,
) -> torch.Tensor:
    """Per-position ``sum_v pi(v)^2`` under ``softmax(logits / temperature)``, never gathering V.

    The optimal-token-baseline estimators (``megarl.algo.optimal_baseline``) need it next to the
    old log-probs; compute it in the same forward pass. With m the global max and
    S_k = sum_v exp(k (z_v - m)): sum pi^2 = S_2 / S_1^2, so each rank reduces its shard's max,
    then S_1 and S_2 over the TP group (padded columns are -inf: they add 0).

    Args:
        logits: ``[B, T, V_local]`` this TP rank's slice of the (padded) vocabulary.
        vocab_size, temperature, vocab_start, group, chunk: as for
            ``vocab_parallel_log_probs_and_entropy``.

    Returns:
        ``[B, T]`` fp32, in [1/V, 1], identical on every TP rank; no gradient (an input of the
        advantage estimator, not of the loss).
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V]; got {tuple(logits.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    seq = logits.shape[1]
    stats_max = torch.empty(logits.shape[:-1], dtype=torch.float32, device=logits.device)
    sum_exp = torch.empty_like(stats_max)
    sum_exp2 = torch.empty_like(stats_max)
    for s in range(0, seq, chunk):
        z = _scaled_masked(logits[:, s : s + chunk], temperature, vocab_start, vocab_size)
        stats_max[:, s : s + chunk] = z.max(dim=-1).values
    _all_reduce(stats_max, dist.ReduceOp.MAX, group)
    for s in range(0, seq, chunk):
        z = _scaled_masked(logits[:, s : s + chunk], temperature, vocab_start, vocab_size)
        e = (z - stats_max[:, s : s + chunk, None]).exp()
        sum_exp[:, s : s + chunk] = e.sum(-1)
        sum_exp2[:, s : s + chunk] = e.square().sum(-1)
    _all_reduce(sum_exp, dist.ReduceOp.SUM, group)
    _all_reduce(sum_exp2, dist.ReduceOp.SUM, group)
    return sum_exp2 / sum_exp.square()
