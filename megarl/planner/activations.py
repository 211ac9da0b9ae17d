"""Activation memory of one training or forward pass per GPU: pure arithmetic.

Notation as in :mod:`megarl.planner.memory`; ``σ`` is ``t`` with sequence parallelism (the
``h``-sized tensors split over TP), else 1. The bytes saved per token and layer are read off the
layer's autograd graph in Megatron-Core 0.16.1, for the local spec (CPU) and the Transformer
Engine spec (GPU); the tests measure them with ``saved_tensors_hooks``, and each function below
gives its formula.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megarl.config.model_dims import ModelDims, padded_vocab_size
from megarl.parallel.layout import ParallelLayout, chunk_layer_counts
from megarl.planner.memory import ITEMSIZE, Role

Impl = Literal["local", "transformer_engine"]
LOGPROB_CHUNK = 1024
"""Positions per chunk of megarl's vocab-parallel log-prob function (``DEFAULT_CHUNK``)."""


@dataclass(frozen=True)
class Recompute:
    """Megatron's activation recomputation settings (granularity None: off)."""

    granularity: Literal["full", "selective"] | None = None
    method: Literal["uniform", "block"] | None = None
    num_layers: int | None = None


@dataclass(frozen=True)
class Activations:
    """Activation bytes of one rank for one pass."""

    saved: int
    """Bytes saved for backward by all micro-batches in flight (the training forward)."""
    working: int
    """Transient bytes on top: one recomputed group, the log-prob working set."""

    @property
    def peak(self) -> int:
        return self.saved + self.working


def layer_bytes_per_token(
    dims: ModelDims,
    layout: ParallelLayout,
    seq_len: int,
    dtype: str,
    impl: Impl,
    *,
    selective: bool = False,
) -> float:
    """Bytes one layer saves per token.

    - local spec (unfused attention, GQA keys/values expanded to ``nq`` heads):
      ``e·(6h/σ + (4·nq·d + 5F)/t + nq·s/t) + 8/σ``: two RMSNorms (input and output, fp32
      ``rstd``), the ``linear_qkv`` and ``linear_fc1`` inputs, q and expanded k, v, the softmax
      probabilities, the ``linear_proj`` input, the SwiGLU MLP (``fc1`` output ``2F``,
      ``silu(gate)`` and the product's operands, ``fc2`` input). In 16-bit two more: the fp32
      softmax output (``4·nq·s/t``) and the norms' fp32 copies of ``h`` (``4·(4 - e)·h/σ``), the
      gap an H100's memory test measured (README, "On a GPU"). RoPE's fp32 cos/sin (``16·s·d``
      per layer, not per token) are the caller's.
    - Transformer Engine spec (flash attention, nothing quadratic in ``s``):
      ``e·(4h/σ + ((nq + 2·nkv)·d + nq·d + 3F)/t) + 8/σ + 4·nq/t`` (the last: the log-sum-exp).

    A MoE layer's MLP is :func:`_moe_bytes_per_token`. ``selective`` recomputation drops the
    attention core (the probabilities, or the log-sum-exp).
    """
    e, t = ITEMSIZE[dtype], layout.tp
    sigma = t if layout.sequence_parallel and t > 1 else 1
    h, f, d = dims.hidden_size, dims.ffn_hidden_size, dims.head_dim
    nq, nkv = dims.num_attention_heads, dims.num_query_groups
    c = 5 if impl == "local" else 3
    mlp = _moe_bytes_per_token(dims, layout, e, c) if dims.is_moe else e * c * f / t
    if impl == "local":
        scores = 0 if selective else nq * seq_len / t
        fp32_softmax = 4 * scores if e < 4 else 0  # its fp32 output beside the e-byte copy
        fp32_norms = 4 * (4 - e) * h / sigma  # two norms, two fp32 copies of h each
        base = e * (6 * h / sigma + 4 * nq * d / t + scores) + mlp + 8 / sigma
        return base + fp32_softmax + fp32_norms
    lse = 0 if selective else 4 * nq / t
    return e * (4 * h / sigma + ((nq + 2 * nkv) * d + nq * d) / t) + mlp + 8 / sigma + lse


def _moe_bytes_per_token(dims: ModelDims, layout: ParallelLayout, e: int, c: int) -> float:
    """A MoE layer's MLP bytes per token of the micro-batch, in place of the dense ``e·cF/t``
    (``c`` widths saved per intermediate element: 5 local, 3 TE): the router's fp32 input,
    logits, probabilities and routing map ``(4h + 9E + 4k)/σ``; per routed (token, expert) pair
    (``k·t_e/σ`` per token with sequence parallelism, ``k`` without; balanced routing, no token
    dropped) the expert's input and output ``2h`` and its MLP ``cF_e/t_e``, times ``e``; a shared
    expert as a dense MLP of width ``F_s``."""
    t, t_e, h = layout.tp, layout.etp, dims.hidden_size
    sigma = t if layout.sequence_parallel and t > 1 else 1
    k, experts = dims.moe_router_topk, dims.num_experts
    pairs = k * t_e / sigma if sigma > 1 else k
    router = (4 * h + 9 * experts + 4 * k) / sigma
    routed = pairs * e * (2 * h + c * dims.moe_ffn_hidden_size / t_e)
    shared = e * c * dims.moe_shared_expert_ffn_hidden_size / t
    return router + routed + shared


def _edge_bytes_per_token(
    dims: ModelDims, layout: ParallelLayout, dtype: str, role: Role, first: bool, last: bool
) -> float:
    """Bytes per token outside the layers: the token ids on the first stage (8); on the last the
    final norm and the output layer's input (``e·3h/σ + 4/σ``), then the actor's vocab-parallel
    logits (``e·V/t``) and the log-prob function's per-token tensors (43), or the critic's
    values (``e + 24``)."""
    e, t = ITEMSIZE[dtype], layout.tp
    sigma = t if layout.sequence_parallel and t > 1 else 1
    out = 8.0 if first else 0.0
    if last:
        out += e * 3 * dims.hidden_size / sigma + 4 / sigma
        if role == "critic":
            out += e + 24
        else:
            out += e * padded_vocab_size(dims.vocab_size, t) / t + 43
    return out


def logprob_working_bytes(
    dims: ModelDims, layout: ParallelLayout, micro_batch: int, seq_len: int, dtype: str
) -> int:
    """``e·b·s·V/(t·c) + 20·b·min(s/c, 1024)·V/t``: logits' gradient plus five fp32 chunks, of
    this rank's ``b·s/c`` tokens (``c``: CP, each rank holds ``1/c`` of every sequence)."""
    local_vocab = padded_vocab_size(dims.vocab_size, layout.tp) // layout.tp
    e, cp = ITEMSIZE[dtype], layout.cp
    return int(
        e * micro_batch * seq_len * local_vocab / cp
        + 20 * micro_batch * min(seq_len / cp, LOGPROB_CHUNK) * local_vocab
    )


def _in_flight(layout: ParallelLayout, micro_batches: int) -> int:
    """Chunk forwards whose activations the first stage holds at once (Megatron's warm-up):
    ``min(p, m)`` with 1F1B, ``2(p-1) + (v-1)p + 1`` (at most ``m·v``) interleaved."""
    p, v = layout.pp, layout.vpp
    if v == 1:
        return min(p, micro_batches)
    return min(micro_batches * v, 2 * (p - 1) + (v - 1) * p + 1)


def training_activations(
    dims: ModelDims,
    layout: ParallelLayout,
    *,
    micro_batch: int,
    seq_len: int,
    micro_batches: int,
    dtype: str,
    impl: Impl,
    role: Role = "actor",
    recompute: Recompute = Recompute(),
) -> Activations:
    """Peak activation bytes on the busiest pipeline stage during a training pass.

    Recomputation: ``full``/``uniform`` over ``n`` layers keeps only the input of every group of
    ``n`` layers (``e·h/σ`` per token) and recomputes one group at a time in the backward pass
    (the working set); ``full``/``block`` recomputes the first ``n`` layers of every chunk and
    keeps the rest; ``selective`` drops the attention core. Context parallelism: each rank holds
    ``1/CP`` of every sequence's tokens (whose queries still see all ``s`` keys).
    """
    tokens = micro_batch * seq_len / layout.cp
    selective = recompute.granularity == "selective"
    full_layer = layer_bytes_per_token(dims, layout, seq_len, dtype, impl, selective=selective)
    rope = 16 * seq_len * dims.head_dim if impl == "local" else 0
    sigma = layout.tp if layout.sequence_parallel and layout.tp > 1 else 1
    in_flight = _in_flight(layout, micro_batches)
    best = Activations(0, 0)
    # Each stage's largest chunk (Megatron's split, uneven stages included).
    for pp_rank, chunks in enumerate(chunk_layer_counts(layout, dims.num_layers)):
        per_chunk = max(chunks)
        kept_layers, inputs_kept, group = per_chunk, 0, 0
        if recompute.granularity == "full":
            n = max(1, min(recompute.num_layers or 1, per_chunk))
            if recompute.method == "block":
                kept_layers, inputs_kept, group = per_chunk - n, n, 1
            else:
                kept_layers, inputs_kept, group = 0, -(-per_chunk // n), n
        chunk_saved = (
            kept_layers * (tokens * full_layer + rope)
            + inputs_kept * tokens * ITEMSIZE[dtype] * dims.hidden_size / sigma
        )
        first, last = pp_rank == 0, pp_rank == layout.pp - 1
        flight = max(1, in_flight - pp_rank * (1 if layout.vpp == 1 else layout.vpp))
        saved = flight * chunk_saved
        saved += tokens * _edge_bytes_per_token(dims, layout, dtype, role, first, last)
        if last and impl == "local":  # the final norm's fp32 copies (layer_bytes_per_token)
            saved += tokens * 2 * (4 - ITEMSIZE[dtype]) * dims.hidden_size / sigma
        working = group * (tokens * full_layer + rope)
        if last and role != "critic":
            working += logprob_working_bytes(dims, layout, micro_batch, seq_len, dtype)
        candidate = Activations(int(saved), int(working))
        if candidate.peak > best.peak:
            best = candidate
    return best


def forward_activations(
    dims: ModelDims,
    layout: ParallelLayout,
    *,
    micro_batch: int,
    seq_len: int,
    dtype: str,
    impl: Impl,
    role: Role = "actor",
) -> Activations:
    """Forward-only pass (log-probs, values): nothing is saved; one layer's tensors plus the
    last stage's outputs and the log-prob working set are transient (``1/CP`` of the tokens)."""
    tokens = micro_batch * seq_len / layout.cp
    layer = tokens * layer_bytes_per_token(dims, layout, seq_len, dtype, impl)
    edge = tokens * _edge_bytes_per_token(dims, layout, dtype, role, False, True)
    work = (
        logprob_working_bytes(dims, layout, micro_batch, seq_len, dtype) if role != "critic" else 0
    )
    return Activations(0, int(layer + edge + work))
