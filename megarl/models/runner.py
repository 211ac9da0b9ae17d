"""Micro-batch runner over Megatron's ``get_forward_backward_func`` (so pipeline parallelism works).

Input: right-padded prompt+response sequences ``input_ids [N, S]`` with per-sequence
``prompt_lengths [N]`` and total ``lengths [N]``. Output: per-response-token tensors ``[N, R]``
(``R = max(lengths - prompt_lengths)``), response-aligned: entry ``[i, k]`` belongs to response
token ``k`` of sequence ``i``, which sits at position ``p_i + k``; it is computed from the model
output at position ``p_i + k - 1`` (position t's logits score token t+1; the critic's value of
the state before that token). Entries past a response's end are 0 and masked by
:func:`response_mask`.

Actor outputs: ``log_probs`` and ``entropy`` of ``softmax(logits / temperature)`` with padded
vocabulary columns masked out (:mod:`megarl.models.logprobs`). Critic outputs: ``values``.
Results computed on the last pipeline stage are broadcast so every rank returns them.

Training mode: ``loss_fn(outputs, micro_batch) -> (loss, metrics)`` is called per micro-batch on
the last stage; the loss is back-propagated as returned. Megatron is configured with
``calculate_per_token_loss`` (see :func:`megarl.models.gpt.build_transformer_config`), so it does
not divide by the number of micro-batches, and DDP sums rather than averages over DP: a loss
normalised by global token/sequence counts gives exactly the full-batch gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from megarl.models.gpt import unwrap
from megarl.models.logprobs import vocab_parallel_log_probs_and_entropy

Outputs = dict[str, torch.Tensor]
LossFn = Callable[[Outputs, dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, float]]]


@dataclass
class RunnerResult:
    """Per-response-token outputs ``[N, R]`` (present on every rank) and per-micro-batch metrics."""

    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    values: torch.Tensor | None = None
    metrics: list[dict[str, float]] = field(default_factory=list)


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


def forward_logits(
    chunks: Sequence[torch.nn.Module],
    micro_batches: Sequence[torch.Tensor],
    keep: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
) -> list[torch.Tensor] | None:
    """Forward-only pass of token-id micro-batches ``[b, s]`` through Megatron's pipeline schedule.

    On the last pipeline stage returns, per micro-batch in order, ``keep(index, logits)`` of its
    vocab-parallel logits ``[b, s, V/TP]`` (the logits themselves when ``keep`` is None),
    detached; None on the other stages. Sequences are right-padded (causal mask only). The
    interleaved (VPP) schedule wants a multiple of PP micro-batches of one shape.
    """
    kept: list[torch.Tensor] = []

    def step(data_iterator, model):
        ids = next(data_iterator)
        seq = ids.shape[1]
        positions = torch.arange(seq, device=ids.device)[None].expand_as(ids)
        output = model(ids, positions, causal_mask(seq, ids.device))

        def loss_func(logits: torch.Tensor):
            kept.append((logits if keep is None else keep(len(kept), logits)).detach())
            return logits.sum() * 0.0, torch.ones((), dtype=torch.int), {}

        return output, loss_func

    interleaved = len(chunks) > 1
    get_forward_backward_func()(
        forward_step_func=step,
        data_iterator=[iter(micro_batches) for _ in chunks] if interleaved else iter(micro_batches),
        model=list(chunks) if interleaved else chunks[0],
        num_microbatches=len(micro_batches),
        seq_length=max(mb.shape[1] for mb in micro_batches),
        micro_batch_size=micro_batches[0].shape[0],
        forward_only=True,
    )
    return kept if parallel_state.is_pipeline_last_stage(ignore_virtual=True) else None


def gather_vocab(local: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Full-vocabulary float32 ``[..., vocab_size]`` from this rank's vocab-parallel shard
    (all-gather over TP; the padded vocabulary columns dropped). Collective over TP."""
    local = local.float().contiguous()
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        group = parallel_state.get_tensor_model_parallel_group()
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local, group=group)
        local = torch.cat(parts, dim=-1)
    return local[..., :vocab_size]


def _device_of(chunks: Sequence[torch.nn.Module]) -> torch.device:
    return next(unwrap(chunks[0]).parameters()).device


def _gather_response(
    per_pos: torch.Tensor, prompt_lengths: torch.Tensor, lengths: torch.Tensor, r: int
) -> torch.Tensor:
    """``out[i, k] = per_pos[i, p_i - 1 + k]`` for real response tokens, 0 past the response."""
    k = torch.arange(r, device=per_pos.device)[None, :]
    idx = (prompt_lengths[:, None] - 1 + k).clamp(0, per_pos.shape[1] - 1)
    valid = k < (lengths - prompt_lengths)[:, None]
    return torch.where(valid, per_pos.gather(1, idx), 0.0)


def run_micro_batches(
    chunks: Sequence[torch.nn.Module],
    input_ids: torch.Tensor,
    prompt_lengths: torch.Tensor,
    lengths: torch.Tensor,
    *,
    kind: Literal["actor", "critic"],
    micro_batch_size: int,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    forward_only: bool = True,
    loss_fn: LossFn | None = None,
    extra: dict[str, torch.Tensor] | None = None,
    logprob_chunk: int = 1024,
) -> RunnerResult:
    """Forward (and, with ``forward_only=False``, backward) over micro-batches of the batch.

    Args:
        chunks: this rank's model chunks (one per VPP stage), plain or DDP-wrapped.
        input_ids: ``[N, S]`` right-padded token ids (same on every TP/PP rank of a DP replica).
        prompt_lengths / lengths: ``[N]`` prompt length (≥ 1) and prompt+response length.
        kind: ``actor`` (log-probs, entropy) or ``critic`` (values).
        vocab_size: the unpadded vocabulary (actor).
        extra: per-sequence tensors ``[N, ...]`` sliced per micro-batch and passed to ``loss_fn``.
    """
    n = input_ids.shape[0]
    if n % micro_batch_size:
        raise ValueError(
            f"batch of {n} sequences is not divisible by micro_batch_size={micro_batch_size}"
        )
    if kind == "actor" and vocab_size is None:
        raise ValueError("kind='actor' needs vocab_size")
    if not forward_only and loss_fn is None:
        raise ValueError("training mode (forward_only=False) needs a loss_fn")
    if bool((prompt_lengths < 1).any()) or bool((lengths < prompt_lengths).any()):
        raise ValueError("need 1 <= prompt_lengths <= lengths for every sequence")
    device = _device_of(chunks)
    input_ids, prompt_lengths, lengths = (
        t.to(device) for t in (input_ids, prompt_lengths, lengths)
    )
    r = int((lengths - prompt_lengths).max().item())
    num_mb = n // micro_batch_size
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if len(chunks) > 1 and num_mb % pp:
        raise ValueError(
            f"the interleaved (VPP) pipeline schedule needs a multiple of PP={pp} micro-batches; "
            f"{n} sequences at micro_batch_size={micro_batch_size} give {num_mb}"
        )
    extra = {k: v.to(device) for k, v in (extra or {}).items()}

    config = unwrap(chunks[0]).config
    micro_batches = []
    for m in range(num_mb):
        sl = slice(m * micro_batch_size, (m + 1) * micro_batch_size)
        # Without variable_seq_lengths (VPP) every micro-batch has the batch's longest length.
        seq = int((lengths[sl] if config.variable_seq_lengths else lengths).max().item())
        mb = {
            "input_ids": input_ids[sl, :seq],
            "prompt_lengths": prompt_lengths[sl],
            "lengths": lengths[sl],
        }
        mb.update({k: v[sl] for k, v in extra.items()})
        micro_batches.append(mb)

    tp_group = parallel_state.get_tensor_model_parallel_group()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    collected: list[Outputs] = []

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        ids = mb["input_ids"]
        seq = ids.shape[1]
        pos = torch.arange(seq, device=ids.device)[None, :].expand_as(ids)
        output = model(ids, pos, causal_mask(seq, ids.device))

        def loss_func(output_tensor: torch.Tensor):
            outputs = _outputs_from_last_stage(output_tensor, mb)
            if forward_only:
                collected.append({k: v.detach() for k, v in outputs.items()})
                zero = output_tensor.sum() * 0.0
                return zero, torch.ones((), dtype=torch.int), {}
            loss, metrics = loss_fn(outputs, mb)  # type: ignore[misc]
            collected.append({k: v.detach() for k, v in outputs.items()})
            return loss, torch.ones((), dtype=torch.int), metrics

        return output, loss_func

    def _outputs_from_last_stage(output_tensor: torch.Tensor, mb: dict) -> Outputs:
        ids = mb["input_ids"]
        if kind == "critic":
            values = output_tensor.squeeze(-1).float()
            return {"values": _gather_response(values, mb["prompt_lengths"], mb["lengths"], r)}
        targets = torch.roll(ids, shifts=-1, dims=1)
        local_vocab = output_tensor.shape[-1]
        logp, ent = vocab_parallel_log_probs_and_entropy(
            output_tensor,
            targets,
            vocab_size=vocab_size,  # type: ignore[arg-type]
            temperature=temperature,
            vocab_start=tp_rank * local_vocab,
            group=tp_group,
            chunk=logprob_chunk,
        )
        return {
            "log_probs": _gather_response(logp, mb["prompt_lengths"], mb["lengths"], r),
            "entropy": _gather_response(ent, mb["prompt_lengths"], mb["lengths"], r),
        }

    chunk_list = list(chunks)
    _configure_grad_sync(chunk_list, forward_only)
    iterators = [iter(micro_batches) for _ in chunk_list]
    fb = get_forward_backward_func()
    losses = fb(
        forward_step_func=forward_step,
        data_iterator=iterators if len(chunk_list) > 1 else iterators[0],
        model=chunk_list if len(chunk_list) > 1 else chunk_list[0],
        num_microbatches=num_mb,
        seq_length=int(lengths.max().item()),
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )
    return _broadcast_results(kind, collected, losses, n, r, device)


def _configure_grad_sync(chunks: list[torch.nn.Module], forward_only: bool) -> None:
    """Hook Megatron DDP's no-sync and grad finalisation into the schedule (DDP-wrapped only)."""
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads

    config = unwrap(chunks[0]).config
    if forward_only or not isinstance(chunks[0], DistributedDataParallel):
        config.no_sync_func = None
        config.finalize_model_grads_func = None
        return
    no_sync = [c.no_sync for c in chunks]
    config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    config.finalize_model_grads_func = finalize_model_grads


def _broadcast_results(
    kind: str,
    collected: list[Outputs],
    metrics: list[dict] | dict,
    n: int,
    r: int,
    device: torch.device,
) -> RunnerResult:
    """Concatenate the last stage's micro-batch outputs and broadcast them over the PP group."""
    names = ["values"] if kind == "critic" else ["log_probs", "entropy"]
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    tensors = {}
    for name in names:
        if last:
            t = torch.cat([c[name] for c in collected]).float().contiguous()
        else:
            t = torch.empty(n, r, dtype=torch.float32, device=device)
        tensors[name] = t
    metric_list = list(metrics) if isinstance(metrics, list) else []
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    if pp_size > 1:
        group = parallel_state.get_pipeline_model_parallel_group()
        src = dist.get_global_rank(group, pp_size - 1)
        for name in names:
            dist.broadcast(tensors[name], src=src, group=group)
        box = [_plain_metrics(metric_list) if last else None]
        dist.broadcast_object_list(box, src=src, group=group)
        metric_list = box[0]  # type: ignore[assignment]
    else:
        metric_list = _plain_metrics(metric_list)
    return RunnerResult(metrics=metric_list, **tensors)


def _plain_metrics(metrics: list[dict]) -> list[dict[str, float]]:
    return [
        {k: float(v.item()) if isinstance(v, torch.Tensor) else float(v) for k, v in m.items()}
        for m in metrics
    ]
