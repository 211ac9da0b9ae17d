"""Micro-batch runner over Megatron's ``get_forward_backward_func`` (so pipeline parallelism works).

Outputs are response-aligned ``[N, R]``: entry ``[i, k]`` is response token ``k`` of sequence
``i`` (position ``p_i + k``), computed from the model output at ``p_i + k - 1``; entries past a
response's end are 0 (:func:`response_mask`), and every rank returns them.

The loss-scaling contract (implemented only in :func:`forward_backward`): Megatron runs with
``calculate_per_token_loss``, so its schedule does not divide by the micro-batch count, DDP sums
gradients over DP×CP, and ``finalize_model_grads`` divides them by the sum of the counts the
loss functions return over DP×CP. megarl's loss function returns the micro-batch's *share* of
the mini-batch loss (``agg_loss`` with the whole mini-batch's counts); the runner multiplies it
by ``G``, the mini-batch's unpadded tokens summed over DP, and reports the unpadded tokens this
rank holds of the micro-batch (under context parallelism its CP share), so Megatron divides by
exactly ``G``: the gradient is the mini-batch loss's however the batch is split. Context
parallelism: each CP peer computes the whole share from outputs gathered over CP with only its
own tokens live, so the peers' gradients add up to the share's once; the MoE routers' losses,
which each rank attaches for its own tokens, add up alike. Without Megatron DDP the share is
back-propagated unscaled and not reduced over DP.

Image prompts (a vision-language actor, :mod:`megarl.models.vision_language`): the batch's
``IMAGES`` extra (:class:`~megarl.models.vl_inputs.ImageRows`) selects each micro-batch's rows'
images; every stage rotates by their 3-D positions and the first stage places their embeddings
(:func:`~megarl.models.vision_language.image_prompt_inputs`). Right-padded rows only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from megarl.models.gpt import chunks_device, unwrap
from megarl.models.packing import (
    PackedRows,
    TokenOrder,
    gather_over_cp,
    pack_rows,
    padded_lengths,
)
from megarl.models.router_losses import AuxLosses
from megarl.models.routing import Routing
from megarl.models.run_outputs import output_fn
from megarl.models.sequences import (
    LogProbs,
    MicroBatches,
    SequenceBatch,
    causal_mask,
    interleaved_multiple,
    micro_batching,
    pad_rows,
    response_mask,
)
from megarl.models.vision_language import image_prompt_inputs
from megarl.models.vl_inputs import IMAGES
from megarl.parallel.collectives import all_gather_tensors

__all__ = [
    "LogProbs",
    "MicroBatches",
    "SequenceBatch",
    "causal_mask",
    "compute_log_probs",
    "compute_scores",
    "compute_values",
    "forward_backward",
    "forward_logits",
    "gather_vocab",
    "interleaved_multiple",
    "micro_batching",
    "pad_rows",
    "response_mask",
]

Outputs = dict[str, torch.Tensor]
Metrics = dict[str, torch.Tensor | float]
LossFn = Callable[[Outputs, dict[str, torch.Tensor]], tuple[torch.Tensor, Metrics]]
"""``loss_fn(outputs, micro_batch) -> (share, metrics)``: ``outputs`` holds ``log_probs`` and
``entropy`` (actor) or ``values`` (critic), each ``[b, R]``; ``micro_batch`` holds the micro-batch's
``input_ids``, ``prompt_lengths``, ``lengths`` and its rows of every ``SequenceBatch.extra`` tensor.
``share`` is the micro-batch's share of the mini-batch loss (see the module docstring); metrics
are 0-dim tensors or floats, as ``megarl.algo``'s losses return them."""


def forward_logits(
    chunks: Sequence[torch.nn.Module],
    micro_batches: Sequence[torch.Tensor],
    keep: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
    lengths: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor] | None:
    """Forward-only pass of token-id micro-batches ``[b, s]`` through Megatron's pipeline schedule.

    On the last pipeline stage returns, per micro-batch in order, ``keep(index, logits)`` of its
    vocab-parallel logits ``[b, s, V/TP]`` (the logits themselves when ``keep`` is None),
    detached; None on the other stages. Sequences are right-padded (causal mask only); under
    context parallelism they run packed, which needs each micro-batch's ``lengths`` (the logits
    are gathered over CP, 0 past each length). The interleaved (VPP) schedule wants a multiple
    of PP micro-batches of one shape.
    """
    kept: list[torch.Tensor] = []
    config = unwrap(chunks[0]).config
    packed = None
    if parallel_state.get_context_parallel_world_size() > 1:
        if lengths is None:
            raise ValueError("context parallelism packs the rows: pass each micro-batch's lengths")
        rows = [
            {"input_ids": ids, "lengths": n} for ids, n in zip(micro_batches, lengths, strict=True)
        ]
        packed = _pack(rows, config)
    numbered = list(enumerate(micro_batches))

    def step(data_iterator, model):
        index, ids = next(data_iterator)
        width = ids.shape[1]
        if packed is not None:
            rows = packed[index]
            output = model(rows.input_ids, rows.position_ids, None, packed_seq_params=rows.params)
        else:
            ids = _pad_for_sequence_parallel(ids, config)
            seq = ids.shape[1]
            positions = torch.arange(seq, device=ids.device)[None].expand_as(ids)
            output = model(ids, positions, causal_mask(seq, ids.device))

        def loss_func(logits: torch.Tensor):
            if packed is not None:
                logits = packed[index].order.to_grid(gather_over_cp(logits[0]))
            logits = logits[:, :width]  # without the sequence-parallel padding
            kept.append((logits if keep is None else keep(len(kept), logits)).detach())
            return logits.sum() * 0.0, torch.ones((), dtype=torch.int), {}

        return output, loss_func

    interleaved = len(chunks) > 1
    get_forward_backward_func()(
        forward_step_func=step,
        data_iterator=[iter(numbered) for _ in chunks] if interleaved else iter(numbered),
        model=list(chunks) if interleaved else chunks[0],
        num_microbatches=len(micro_batches),
        seq_length=(
            max(p.length for p in packed)
            if packed is not None
            else _sequence_parallel_length(max(mb.shape[1] for mb in micro_batches), config)
        ),
        micro_batch_size=1 if packed is not None else micro_batches[0].shape[0],
        forward_only=True,
    )
    return kept if parallel_state.is_pipeline_last_stage(ignore_virtual=True) else None


def gather_vocab(local: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Full-vocabulary float32 ``[..., vocab_size]`` from this rank's vocab-parallel shard
    (all-gather over TP; the padded vocabulary columns dropped). Collective over TP."""
    local = local.float().contiguous()
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        group = parallel_state.get_tensor_model_parallel_group()
        local = torch.cat(all_gather_tensors(local, group), dim=-1)
    return local[..., :vocab_size]


def compute_log_probs(
    chunks: Sequence[torch.nn.Module],
    batch: SequenceBatch,
    *,
    vocab_size: int,
    micro_batches: MicroBatches,
    temperature: float = 1.0,
    sum_pi_squared: bool = False,
    routing: Routing | None = None,
    pack: bool = False,
    topk: int | None = None,
) -> LogProbs:
    """Log-probs and entropy ``[N, R]`` of every response token (forward only); with
    ``sum_pi_squared`` also sum_v pi(v)^2 at each of those positions (same forward pass); with a
    recording ``routing`` also the MoE routers' choices (``LogProbs.routing``), with a replaying
    one the routers replay the batch's ``routing`` extra (:mod:`megarl.models.routing`).
    ``pack``: as :func:`forward_backward`'s. ``topk`` (a teacher's scores): also the ``topk``
    largest log-probs at each of those positions and their ids, ``[N, R, topk]``
    (:func:`megarl.models.topk_logprobs.vocab_parallel_topk_log_probs`)."""
    out = _run(
        chunks,
        batch,
        "actor",
        micro_batches,
        vocab_size=vocab_size,
        temperature=temperature,
        sum_pi_squared=sum_pi_squared,
        routing=routing,
        pack=pack,
        topk=topk,
    )
    t = out.tensors
    result = LogProbs(t["log_probs"], t["entropy"], t.get("sum_pi_squared"), out.routing)
    if topk is not None:
        result.topk_log_probs, result.topk_ids = t["topk_log_probs"], t["topk_ids"].long()
    return result


def compute_values(
    chunks: Sequence[torch.nn.Module],
    batch: SequenceBatch,
    *,
    micro_batches: MicroBatches,
    pack: bool = False,
) -> torch.Tensor:
    """Critic values ``[N, R]`` of the state before every response token (forward only)."""
    return _run(chunks, batch, "critic", micro_batches, pack=pack).tensors["values"]


def compute_scores(
    chunks: Sequence[torch.nn.Module],
    batch: SequenceBatch,
    *,
    micro_batches: MicroBatches,
    pack: bool = False,
) -> torch.Tensor:
    """Reward-model scores ``[N]``: the scalar head's output at each sequence's last valid token
    (position ``lengths - 1``; ``prompt_lengths`` only need to be in 1..lengths). HF's
    ``*ForSequenceClassification`` takes the last token that is not ``pad_token_id``: the same
    token unless the sequence itself ends in the pad id (forward only)."""
    return _run(chunks, batch, "reward", micro_batches, pack=pack).tensors["scores"][:, 0]


def forward_backward(
    chunks: Sequence[torch.nn.Module],
    batch: SequenceBatch,
    loss_fn: LossFn,
    *,
    micro_batches: MicroBatches,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    keep_outputs: bool = False,
    routing: Routing | None = None,
    pack: bool = False,
):
    """Forward and backward of one mini-batch; returns each micro-batch's metrics (every rank),
    and with ``keep_outputs`` also the outputs ``[N, R]`` (log-probs and entropy, or values) of
    the forward pass, as :func:`compute_log_probs` / :func:`compute_values` would give them.

    Gradients accumulate in the chunks (Megatron DDP buffers when wrapped); step the optimizer
    afterwards. An actor (``vocab_size`` given) passes ``log_probs`` and ``entropy`` to
    ``loss_fn``, a critic (``vocab_size`` None) ``values``. Scaling: see the module docstring.
    ``routing`` (a replaying :class:`~megarl.models.routing.Routing`): the MoE routers replay
    the choices in the batch's ``routing`` extra (recorded by :func:`compute_log_probs`) and
    count their agreement. ``pack``: each micro-batch runs as one packed row (THD,
    :mod:`megarl.models.packing`; needed under context parallelism), outputs as without.
    """
    role = "actor" if vocab_size is not None else "critic"
    out = _run(
        chunks,
        batch,
        role,
        micro_batches,
        vocab_size=vocab_size,
        temperature=temperature,
        loss_fn=loss_fn,
        routing=routing,
        pack=pack,
    )
    return (out.metrics, out.tensors) if keep_outputs else out.metrics


@dataclass
class _RunOutput:
    tensors: dict[str, torch.Tensor]
    metrics: list[dict[str, float]]
    routing: torch.Tensor | None = None


def _micro_batch_rows(n: int, micro_batches: MicroBatches, device: torch.device) -> list:
    if isinstance(micro_batches, int):
        if micro_batches < 1 or n % micro_batches:
            raise ValueError(
                f"batch of {n} sequences is not divisible by micro_batch_size={micro_batches}"
            )
        return [
            torch.arange(i, i + micro_batches, device=device) for i in range(0, n, micro_batches)
        ]
    rows = [torch.as_tensor(r, dtype=torch.long, device=device) for r in micro_batches]
    seen = torch.cat(rows).sort().values if rows else torch.empty(0, dtype=torch.long)
    if not torch.equal(seen.cpu(), torch.arange(n)):
        raise ValueError("micro-batch row indices must cover every sequence of the batch once")
    return rows


def _run(
    chunks: Sequence[torch.nn.Module],
    batch: SequenceBatch,
    role: str,
    micro_batches: MicroBatches,
    *,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    loss_fn: LossFn | None = None,
    sum_pi_squared: bool = False,
    routing: Routing | None = None,
    pack: bool = False,
    topk: int | None = None,
) -> _RunOutput:
    if bool((batch.prompt_lengths < 1).any()) or bool((batch.lengths < batch.prompt_lengths).any()):
        raise ValueError("need 1 <= prompt_lengths <= lengths for every sequence")
    cp = parallel_state.get_context_parallel_world_size()
    if pack and IMAGES in batch.extra:
        raise NotImplementedError("packed rows (THD) of image prompts are not built: pack=False")
    if cp > 1 and not pack:
        raise ValueError(f"context parallelism (CP={cp}) needs packed sequences (pack=True)")
    device = chunks_device(chunks)
    input_ids, prompt_lengths, lengths = (
        t.to(device) for t in (batch.input_ids, batch.prompt_lengths, batch.lengths)
    )
    extra = {k: v.to(device) for k, v in batch.extra.items()}
    n, r = len(batch), 1 if role == "reward" else batch.response_width
    rows = _micro_batch_rows(n, micro_batches, device)
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if len(chunks) > 1 and (len(rows) % pp or len({len(x) for x in rows}) > 1):
        raise ValueError(
            f"the interleaved (VPP) pipeline schedule needs a multiple of PP={pp} micro-batches "
            f"of one size; got sizes {[len(x) for x in rows]}"
        )
    config = unwrap(chunks[0]).config
    if not pack:
        input_ids = _pad_for_sequence_parallel(input_ids, config)
    micro = []
    for idx in rows:
        # Without variable_seq_lengths (VPP) every micro-batch has the batch's longest length.
        seq = int((lengths[idx] if config.variable_seq_lengths else lengths).max().item())
        seq = seq if pack else _sequence_parallel_length(seq, config)
        mb = {
            "input_ids": input_ids[idx, :seq],
            "prompt_lengths": prompt_lengths[idx],
            "lengths": lengths[idx],
        }
        mb.update({k: v[idx] for k, v in extra.items()})
        micro.append(mb)
    packed = _pack(micro, config) if pack else None
    orders = (
        [p.order for p in packed]
        if packed is not None
        else [TokenOrder.padded(len(mb["lengths"]), mb["input_ids"].shape[1]) for mb in micro]
    )

    training = loss_fn is not None
    ddp = _configure_grad_sync(list(chunks), training)
    scale = _global_token_count(lengths, device) if ddp else 1.0
    collected: list[Outputs] = []
    outputs_of = output_fn(role, r, vocab_size, temperature, sum_pi_squared, topk)
    moe = bool(config.num_moe_experts)
    aux = AuxLosses(len(micro)) if moe and training else None
    recorded = None
    if routing is not None and routing.mode == "record":
        recorded = routing.empty(n, input_ids.shape[1])

    def forward_step(data_iterator, model):
        index, mb = next(data_iterator)
        if packed is None:
            ids = mb["input_ids"]
            seq = ids.shape[1]
            pos = torch.arange(seq, device=ids.device)[None, :].expand_as(ids)
            padding = pos >= mb["lengths"][:, None]
            layout = {}
            if IMAGES in mb:  # a VL actor: 3-D positions, the images placed on the first stage
                pos, layout["decoder_input"] = image_prompt_inputs(
                    model, ids, mb["lengths"], mb[IMAGES]
                )
            inputs = (ids, pos, causal_mask(seq, ids.device))
        else:
            rows_packed = packed[index]
            padding = rows_packed.padding
            inputs = (rows_packed.input_ids, rows_packed.position_ids, None)
            layout = {"packed_seq_params": rows_packed.params}
        # MoE: padding routes like any token, but stays out of the routers' auxiliary losses.
        pads = {"padding_mask": _padding_mask(model, padding)} if moe else {}
        if aux is not None:
            aux.before()
        if routing is not None:
            routing.before(model, mb, orders[index])
        output = model(*inputs, **layout, **pads)
        if routing is not None:
            routing.after(model, recorded, rows[index], orders[index])
        if aux is not None:
            aux.after(index, float(mb["lengths"].sum()))

        def loss_func(output_tensor: torch.Tensor):
            outputs = outputs_of(output_tensor, mb, packed[index].order if packed else None)
            collected.append({k: v.detach() for k, v in outputs.items()})
            if packed is None:
                count = mb["lengths"].sum().to(torch.int)
            else:  # this CP rank's unpadded tokens (all of them without CP)
                count = (packed[index].order.local >= 0).sum().to(torch.int)
            if not training:
                return output_tensor.sum() * 0.0, count, {}
            share, metrics = loss_fn(outputs, mb)  # type: ignore[misc]
            return share * scale, count, metrics

        return output, loss_func

    chunk_list = list(chunks)
    iterators = [iter(list(enumerate(micro))) for _ in chunk_list]
    with _mode(chunk_list, training):
        metrics = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterators if len(chunk_list) > 1 else iterators[0],
            model=chunk_list if len(chunk_list) > 1 else chunk_list[0],
            num_microbatches=len(micro),
            seq_length=(
                max(p.length for p in packed)
                if packed is not None
                else _sequence_parallel_length(int(lengths.max().item()), config)
            ),
            micro_batch_size=1 if packed is not None else max(len(x) for x in rows),
            forward_only=not training,
        )
    names = {"critic": ["values"], "reward": ["scores"]}.get(role, ["log_probs", "entropy"])
    if sum_pi_squared:
        names.append("sum_pi_squared")
    trailing = {}
    if topk is not None:  # the ids travel as floats: exact below 2^24 (fp32) or 2^53
        names += ["topk_log_probs", "topk_ids"]
        trailing = {"topk_log_probs": (topk,), "topk_ids": (topk,)}
    dtype = torch.promote_types(next(unwrap(chunks[0]).parameters()).dtype, torch.float32)
    out = _broadcast_results(names, collected, metrics, torch.cat(rows), n, r, device, dtype,
                             trailing)  # fmt: skip
    if aux is not None:
        aux.add_shares(out.metrics, chunk_list, scale if ddp else float(lengths.sum()))
    out.routing = recorded
    return out


@contextlib.contextmanager
def _mode(chunks: list[torch.nn.Module], training: bool) -> Iterator[None]:
    """Train mode for an update, eval mode for a forward-only pass (log-probs, values, scores),
    as verl's ``compute_log_prob`` / ``update_policy`` set it: dropout (attention, hidden, LoRA's)
    acts only in updates. Each chunk's own mode comes back afterwards."""
    before = [c.training for c in chunks]
    for c in chunks:
        c.train(training)
    try:
        yield
    finally:
        for c, mode in zip(chunks, before, strict=True):
            c.train(mode)


def _padding_mask(model: torch.nn.Module, mask: torch.Tensor) -> torch.Tensor:
    """The routers' padding mask ``[b, s]`` (True: padding) as ``model`` takes it. Under sequence
    parallelism Megatron 0.16.1 cuts it to the TP rank's slice of the sequence only where it
    embeds (the first pipeline stage); a later stage gets its slice here."""
    inner = unwrap(model)
    if not inner.config.sequence_parallel or inner.pre_process:
        return mask
    tp = parallel_state.get_tensor_model_parallel_world_size()
    width = mask.shape[1] // tp
    start = parallel_state.get_tensor_model_parallel_rank() * width
    return mask[:, start : start + width]


def _sequence_parallel_length(seq: int, config) -> int:
    """``seq`` rounded up to a multiple of TP under sequence parallelism, which splits the
    sequence over the TP ranks (the extra positions are right padding: causally invisible to the
    real tokens, their outputs dropped)."""
    tp = config.tensor_model_parallel_size
    return -(-seq // tp) * tp if config.sequence_parallel and tp > 1 else seq


def _pad_for_sequence_parallel(input_ids: torch.Tensor, config) -> torch.Tensor:
    """``input_ids`` widened with pad columns (token 0) to the sequence-parallel length."""
    width = _sequence_parallel_length(input_ids.shape[1], config)
    return torch.nn.functional.pad(input_ids, (0, width - input_ids.shape[1]))


def _pack(micro: list[dict], config) -> list[PackedRows]:
    """Each micro-batch as one packed row (:mod:`megarl.models.packing`), every sequence padded
    to a multiple of 2·CP (under CP), times TP under sequence parallelism; without
    ``variable_seq_lengths`` (VPP, the allgather dispatcher) every row as long as the longest."""
    cp = config.context_parallel_size
    multiple = (2 * cp if cp > 1 else 1) * (
        config.tensor_model_parallel_size if config.sequence_parallel else 1
    )
    total = None
    if not config.variable_seq_lengths:
        total = max(sum(padded_lengths(mb["lengths"].tolist(), multiple)) for mb in micro)
    return [
        pack_rows(mb["input_ids"], mb["lengths"], multiple=multiple, total=total) for mb in micro
    ]


def _global_token_count(lengths: torch.Tensor, device: torch.device) -> float:
    """Tokens (without padding) of the mini-batch summed over DP (Megatron's divisor: the counts
    it sums over DP×CP add up to it, each CP rank reporting its share)."""
    total = lengths.sum().to(torch.float64).reshape(1).to(device)
    group = parallel_state.get_data_parallel_group()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return float(total.item())


def _configure_grad_sync(chunks: list[torch.nn.Module], training: bool) -> bool:
    """Hook Megatron DDP's no-sync and grad finalisation into the schedule when training a
    DDP-wrapped model; returns whether it did."""
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads

    config = unwrap(chunks[0]).config
    if not training or not isinstance(chunks[0], DistributedDataParallel):
        config.no_sync_func = None
        config.finalize_model_grads_func = None
        return False
    no_sync = [c.no_sync for c in chunks]
    config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return True


def _broadcast_results(
    names: list[str],
    collected: list[Outputs],
    metrics: list[dict] | dict,
    order: torch.Tensor,
    n: int,
    r: int,
    device: torch.device,
    dtype: torch.dtype,
    trailing: dict[str, tuple[int, ...]] | None = None,
) -> _RunOutput:
    """Join the last stage's micro-batch outputs in batch order and broadcast them over PP
    (``dtype``: at least fp32; float64 models keep float64; ``trailing``: a name's dimensions
    after ``[n, r]``)."""
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    tensors = {}
    for name in names:
        t = torch.zeros(n, r, *(trailing or {}).get(name, ()), dtype=dtype, device=device)
        if last:
            t[order] = torch.cat([c[name] for c in collected]).to(dtype)
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
    return _RunOutput(tensors, metric_list)


def _plain_metrics(metrics: list[dict]) -> list[dict[str, float]]:
    return [
        {k: float(v.item()) if isinstance(v, torch.Tensor) else float(v) for k, v in m.items()}
        for m in metrics
    ]
