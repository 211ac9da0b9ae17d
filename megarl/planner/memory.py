"""Per-GPU memory terms of a model on a layout, in bytes: pure arithmetic.

Every function takes the one model shape (:class:`ModelDims`) and the one layout
(:class:`ParallelLayout`). Notation: ``h`` hidden size, ``F`` FFN width, ``L`` layers,
``nq``/``nkv`` query/KV heads, ``d`` head width, ``V`` vocabulary padded to a multiple of 128·TP,
``t`` TP, ``p`` PP, ``v`` VPP, ``N`` DP, ``b`` micro-batch (sequences), ``s`` sequence length,
``e`` bytes per parameter; MoE: ``E`` experts of width ``F_e``, top-``k``, expert TP ``t_e``.
Model state follows Megatron-Core 0.16.1's DDP buffers and optimizers as megarl builds them
(:func:`grad_buffer`, :func:`model_state`); on GPU the optimizer assumed is Transformer Engine's
``FusedAdam`` with fp32 states (16-bit moments and parameter remainders are not modelled).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from megarl.config.model_dims import ModelDims, padded_vocab_size
from megarl.parallel.layout import ParallelLayout, chunk_layer_range

Role = Literal["actor", "critic", "ref"]
Dtype = Literal["bf16", "fp32"]
AdamKind = Literal["fused", "torch"]

ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4}
GIB = 1 << 30


@dataclass(frozen=True)
class ParamSlot:
    """One parameter tensor of a rank's model chunk (Megatron's local-spec name)."""

    name: str
    numel: int
    shared_embedding: bool = False
    """Megatron marks the tied embedding's two copies (PP > 1); they get a bucket of their own."""
    norm: bool = False
    """An RMSNorm weight (the model dtype in both specs: megarl casts the local spec's
    ``torch.nn.RMSNorm`` to ``params_dtype``, as Transformer Engine builds it)."""
    expert: bool = False
    """A routed expert's weight: reduced and sharded over the expert-data-parallel group."""


def chunk_params(
    dims: ModelDims, layout: ParallelLayout, pp_rank: int, vp_stage: int = 0, role: Role = "actor"
) -> list[ParamSlot]:
    """Parameters of chunk ``vp_stage`` on stage ``pp_rank`` and any TP rank, in the order of
    ``GPTModel.named_parameters()`` (local spec; the TE spec holds the same tensors).

    Per layer on a TP rank: norms ``2h``; ``linear_qkv`` ``(nq + 2·nkv)·d/t × h`` (+ the same
    rows of bias for Qwen2); ``linear_proj`` ``h × nq·d/t``; q/k norms ``2d`` (Qwen3);
    ``linear_fc1`` ``2F/t × h``; ``linear_fc2`` ``h × F/t`` (MoE: :func:`moe_mlp_params`).
    Embedding ``V/t × h`` on the first chunk; final norm ``h`` and output layer ``V/t × h``
    (critic: value head ``h``) on the last. The slots are those of any EP rank (each holds
    ``E/EP`` experts).
    """
    t, h, d = layout.tp, dims.hidden_size, dims.head_dim
    vocab = padded_vocab_size(dims.vocab_size, t)
    first = pp_rank == 0 and vp_stage == 0
    last = pp_rank == layout.pp - 1 and vp_stage == layout.vpp - 1
    tied = dims.tie_word_embeddings and role != "critic"
    out: list[ParamSlot] = []
    if first:
        out.append(ParamSlot("embedding.word_embeddings.weight", vocab // t * h, tied and not last))
    qkv_rows = (dims.num_attention_heads + 2 * dims.num_query_groups) * d // t
    for layer in chunk_layer_range(layout, dims.num_layers, pp_rank, vp_stage):
        pre = f"decoder.layers.{layer}."
        out.append(ParamSlot(pre + "input_layernorm.weight", h, norm=True))
        out.append(
            ParamSlot(
                pre + "self_attention.linear_proj.weight", h * dims.num_attention_heads * d // t
            )
        )
        out.append(ParamSlot(pre + "self_attention.linear_qkv.weight", qkv_rows * h))
        if dims.qkv_bias:
            out.append(ParamSlot(pre + "self_attention.linear_qkv.bias", qkv_rows))
        if dims.qk_norm:
            out.append(ParamSlot(pre + "self_attention.q_layernorm.weight", d, norm=True))
            out.append(ParamSlot(pre + "self_attention.k_layernorm.weight", d, norm=True))
        out.append(ParamSlot(pre + "pre_mlp_layernorm.weight", h, norm=True))
        if dims.is_moe:
            out += moe_mlp_params(dims, layout, pre)
        else:
            out.append(ParamSlot(pre + "mlp.linear_fc1.weight", 2 * dims.ffn_hidden_size // t * h))
            out.append(ParamSlot(pre + "mlp.linear_fc2.weight", h * dims.ffn_hidden_size // t))
    if last:
        out.append(ParamSlot("decoder.final_layernorm.weight", h, norm=True))
        if role == "critic":
            out.append(ParamSlot("output_layer.weight", h))
        elif not tied:
            out.append(ParamSlot("output_layer.weight", vocab // t * h))
        elif not first:  # tied at PP > 1: the last stage holds a copy of the embedding
            out.append(ParamSlot("output_layer.weight", vocab // t * h, True))
    return out


def moe_mlp_params(dims: ModelDims, layout: ParallelLayout, prefix: str) -> list[ParamSlot]:
    """One MoE layer's MLP on any rank (Megatron's local-spec names, ``MoELayer`` order):
    router ``E × h``; ``E/EP`` local experts, ``linear_fc1`` ``2F_e/t_e × h`` and ``linear_fc2``
    ``h × F_e/t_e`` each; the shared expert ``2F_s/t × h``, ``h × F_s/t`` and its gate ``h``."""
    h, f, t_e = dims.hidden_size, dims.moe_ffn_hidden_size, layout.etp
    out = [ParamSlot(prefix + "mlp.router.weight", dims.num_experts * h)]
    for j in range(dims.num_experts // layout.ep):
        expert = f"{prefix}mlp.experts.local_experts.{j}."
        out.append(ParamSlot(expert + "linear_fc1.weight", 2 * f // t_e * h, expert=True))
        out.append(ParamSlot(expert + "linear_fc2.weight", h * f // t_e, expert=True))
    shared = dims.moe_shared_expert_ffn_hidden_size
    if shared:
        t = layout.tp
        out.append(ParamSlot(prefix + "mlp.shared_experts.linear_fc1.weight", 2 * shared // t * h))
        out.append(ParamSlot(prefix + "mlp.shared_experts.linear_fc2.weight", h * shared // t))
        out.append(ParamSlot(prefix + "mlp.shared_experts.gate_weight", h))
    return out


def lora_params(dims: ModelDims, slots: list[ParamSlot], rank: int) -> list[ParamSlot]:
    """The LoRA adapters of a chunk's linears on a TP rank (:mod:`megarl.models.lora`):
    column-parallel (``linear_qkv``, ``linear_fc1``) A ``r × h`` replicated, B ``rows/t × r``;
    row-parallel (``linear_proj``, ``linear_fc2``) A ``r × cols/t``, B ``h × r``. MoE: the
    shared expert's as a dense MLP's; each local routed expert's (expert TP 1, not split) the
    same shapes, marked ``expert`` (reduced and sharded over expert-DP, as the experts)."""
    h, out = dims.hidden_size, []
    for s in slots:
        if s.name.endswith(("linear_qkv.weight", "linear_fc1.weight")):
            out += [ParamSlot(s.name + ".lora.A", rank * h, expert=s.expert),
                    ParamSlot(s.name + ".lora.B", s.numel // h * rank, expert=s.expert)]  # fmt: skip
        elif s.name.endswith(("linear_proj.weight", "linear_fc2.weight")):
            out += [ParamSlot(s.name + ".lora.A", rank * (s.numel // h), expert=s.expert),
                    ParamSlot(s.name + ".lora.B", h * rank, expert=s.expert)]  # fmt: skip
    return out


@dataclass(frozen=True)
class GradBuffer:
    """Megatron's contiguous parameter/gradient buffer of one chunk (``_ParamAndGradBuffer``)."""

    numel: int
    """Elements including padding."""
    buckets: tuple[tuple[int, int], ...]
    """(start, end) of every bucket."""
    ranges: tuple[tuple[int, int], ...]
    """(start, end) of every parameter (in the order of :func:`chunk_params`)."""


def grad_buffer(params: list[ParamSlot], dp: int, distributed_optimizer: bool) -> GradBuffer:
    """Lay out ``params`` as Megatron 0.16.1 does with one bucket (no ``bucket_size``).

    Parameters are placed in reverse order. With the distributed optimizer every parameter
    starts at a multiple of 64 elements and every bucket ends at a multiple of lcm(N, 128); a
    ``shared_embedding`` parameter closes the bucket before it and forms its own.
    """

    def pad(n: int, k: int) -> int:
        return -(-n // k) * k if distributed_optimizer else n

    end_divisor = math.lcm(dp, 128)
    buckets: list[tuple[int, int]] = []
    ranges: dict[int, tuple[int, int]] = {}
    bucket_start = cursor = 0
    open_bucket = False
    for index in range(len(params) - 1, -1, -1):
        slot = params[index]
        cursor = pad(cursor, 64)
        own = slot.shared_embedding and distributed_optimizer
        if own and open_bucket:
            cursor = pad(cursor, end_divisor)
            buckets.append((bucket_start, cursor))
            bucket_start = cursor
        ranges[index] = (cursor, cursor + slot.numel)
        cursor += slot.numel
        open_bucket = True
        if own:
            cursor = pad(cursor, end_divisor)
            buckets.append((bucket_start, cursor))
            bucket_start, open_bucket = cursor, False
    if open_bucket:
        cursor = pad(cursor, end_divisor)
        buckets.append((bucket_start, cursor))
    return GradBuffer(cursor, tuple(buckets), tuple(ranges[i] for i in range(len(params))))


def owned_elements(
    buffer: GradBuffer, dp: int, dp_rank: int, only: set[int] | None = None
) -> tuple[int, int]:
    """(elements, parameter tensors) the distributed optimizer updates on ``dp_rank``: the
    parameters' overlap with the rank's slice ``[r·n/N, (r+1)·n/N)`` of every bucket
    (``only``: counting the parameters of these indices only)."""
    elements = tensors = 0
    for start, end in buffer.buckets:
        size = (end - start) // dp
        lo, hi = start + dp_rank * size, start + (dp_rank + 1) * size
        for index, (p_start, p_end) in enumerate(buffer.ranges):
            if only is not None and index not in only:
                continue
            overlap = min(hi, p_end) - max(lo, p_start)
            if overlap > 0:
                elements += overlap
                tensors += 1
    return elements, tensors


@dataclass(frozen=True)
class OptimizerAssumptions:
    """How a model's parameters and optimizer are configured (what changes their bytes)."""

    dtype: Dtype = "bf16"
    """Parameter dtype (``trainer.dtype``)."""
    distributed_optimizer: bool = True
    """``*.megatron.use_distributed_optimizer``."""
    grad_reduce_in_fp32: bool = True
    """Gradient buffers in fp32 (megarl's default for 16-bit parameters)."""
    optimizer: Literal["adam", "sgd"] = "adam"
    """``*.optim.optimizer``; sgd without momentum has no state."""
    adam: AdamKind = "fused"
    """``fused``: TE FusedAdam (GPU, no per-tensor step); ``torch``: torch.optim.Adam (CPU)."""
    impl: Literal["local", "transformer_engine"] = "transformer_engine"
    """Layer spec (local on CPU, Transformer Engine on GPU); both hold the same parameters."""
    lora_rank: int = 0
    """LoRA adapters' rank on every dense linear (0: full weights): the base then holds
    parameters only, the adapters (:func:`lora_params`) parameters, gradients and optimizer."""


@dataclass(frozen=True)
class ModelState:
    """Bytes one rank holds for one model (parameters, gradients, optimizer)."""

    params: int
    grads: int
    main_params: int
    optimizer_states: int
    experts: ModelState | None = None
    """The routed experts' share of the four totals above (None: a dense model)."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.main_params + self.optimizer_states

    def __add__(self, other: ModelState) -> ModelState:
        return ModelState(
            self.params + other.params,
            self.grads + other.grads,
            self.main_params + other.main_params,
            self.optimizer_states + other.optimizer_states,
        )


def _by_dtype(slots: list[ParamSlot], opt: OptimizerAssumptions) -> dict[int, list[ParamSlot]]:
    """Slots per parameter itemsize: DDP keeps one buffer per (param, grad) dtype pair."""
    e = ITEMSIZE[opt.dtype]
    groups: dict[int, list[ParamSlot]] = {}
    for slot in slots:
        size = e
        groups.setdefault(size, []).append(slot)
    return groups


def _buffers_state(
    slots: list[ParamSlot], dp: int, dp_rank: int, role: Role, opt: OptimizerAssumptions
) -> tuple[ModelState, ModelState]:
    """Bytes of the buffers Megatron's DDP builds for ``slots`` reduced over ``dp`` ranks, and
    the routed experts' share of them (a buffer of experts only: its padding too)."""
    total, experts = [0, 0, 0, 0], [0, 0, 0, 0]
    for e, group in _by_dtype(slots, opt).items():
        chosen = {i for i, s in enumerate(group) if s.expert}
        mine = sum(group[i].numel for i in chosen)
        if role == "ref":
            total[0] += e * sum(s.numel for s in group)
            experts[0] += e * mine
            continue
        g = 4 if opt.grad_reduce_in_fp32 else e
        buffer = grad_buffer(group, dp, opt.distributed_optimizer)
        if len(chosen) == len(group):
            mine = buffer.numel
        if opt.distributed_optimizer:
            counts = [
                owned_elements(buffer, dp, dp_rank),
                owned_elements(buffer, dp, dp_rank, chosen),
            ]
        else:
            counts = [(buffer.numel, len(group)), (mine, len(chosen))]
        for out, numel, (updated, tensors) in ((total, buffer.numel, counts[0]),
                                               (experts, mine, counts[1])):  # fmt: skip
            out[0] += e * numel
            out[1] += g * numel
            out[2] += 4 * updated if e < 4 else 0
            if opt.optimizer == "adam":
                out[3] += 8 * updated + (4 * tensors if opt.adam == "torch" else 0)
    return ModelState(*total), ModelState(*experts)


def model_state(
    dims: ModelDims,
    layout: ParallelLayout,
    world: int,
    role: Role,
    opt: OptimizerAssumptions,
    *,
    pp_rank: int | None = None,
    dp_rank: int = 0,
) -> ModelState:
    """Bytes on one rank of stage ``pp_rank`` (None: the stage holding most) and ``dp_rank``.

    Formulas (``n`` this rank's elements, ``n_pad`` with buffer padding, ``k`` the elements it
    updates, ``j`` its main-parameter tensors): params ``e·n_pad`` (distributed optimizer) or
    ``e·n``; grads ``g·n_pad`` with ``g`` = 4 (``grad_reduce_in_fp32``) or ``e``; main params
    ``4·k`` when ``e`` < 4; Adam ``8·k`` (+ ``4·j`` with torch's Adam). ``k`` = ``n`` without the
    distributed optimizer. Each (parameter dtype, gradient dtype) pair has its own buffer. A
    reference model (``ref``) holds parameters only.

    MoE: at EP > 1 the experts form buffers of their own over the expert-data-parallel group
    (``k`` = their ``n_pad/N_e``); at EP = 1 they are counted in the dense buffers. (megarl's
    ``build_model`` gives them buffers of their own at EP 1 too, so that checkpoints resume
    across EP; there expert-DP = DP when ETP = TP, and only the buffer padding differs, which is
    not modelled.) ``experts`` is their share.
    """
    if pp_rank is None:
        stages = [model_state(dims, layout, world, role, opt, pp_rank=r) for r in range(layout.pp)]
        return max(stages, key=lambda s: s.total)
    # Megatron's DDP reduces gradients, and its distributed optimizer shards, over DP × CP (the
    # context-parallel peers hold the same parameters); the experts' group already spans CP.
    dp = layout.data_parallel_size(world) * layout.cp
    total = experts = ModelState(0, 0, 0, 0)
    for vp_stage in range(layout.vpp):
        slots = chunk_params(dims, layout, pp_rank, vp_stage, role)
        if opt.lora_rank > 0 and role == "actor":  # frozen base + trained adapters
            base, base_experts = _buffers_state(slots, dp, dp_rank, "ref", opt)
            experts = experts + base_experts  # the frozen experts' parameters
            adapters = lora_params(dims, slots, opt.lora_rank)
            trained, _ = _buffers_state([a for a in adapters if not a.expert], dp, dp_rank,
                                        role, opt)  # fmt: skip
            routed = [a for a in adapters if a.expert]  # DDP's expert buffers, over expert-DP
            if routed:
                edp = layout.expert_data_parallel_size(world)
                _, share = _buffers_state(routed, edp, dp_rank % edp, role, opt)
                trained, experts = trained + share, experts + share
            total = total + base + trained
        elif dims.is_moe and layout.ep > 1:
            dense, _ = _buffers_state([s for s in slots if not s.expert], dp, dp_rank, role, opt)
            edp = layout.expert_data_parallel_size(world)
            routed = [s for s in slots if s.expert]
            _, share = _buffers_state(routed, edp, dp_rank % edp, role, opt)
            total, experts = total + dense + share, experts + share
        else:
            both, share = _buffers_state(slots, dp, dp_rank, role, opt)
            total, experts = total + both, experts + share
    if not dims.is_moe:
        return total
    return ModelState(total.params, total.grads, total.main_params, total.optimizer_states, experts)


# ---------------------------------------------------------------------------------------------
# vLLM weights
# ---------------------------------------------------------------------------------------------

VLLM_VOCAB_PADDING = 64
"""vLLM pads vocab-parallel embeddings to a multiple of this many rows before splitting them."""


def vllm_weight_bytes(dims: ModelDims, rollout_tp: int, itemsize: int = 2) -> int:
    """Weight bytes one vLLM TP rank keeps (``T`` = rollout TP; KV heads replicated past nkv).

    Per layer: norms ``2h``; q ``nq·d/T × h`` and k, v ``max(nkv/T, 1)·d × h`` each (+ biases of
    the same rows for Qwen2); o ``h × nq·d/T``; gate, up ``F/T × h`` each; down ``h × F/T``; q/k
    norms ``2d`` (Qwen3). Embedding (and an untied ``lm_head``) ``ceil64(vocab)/T × h``; final
    norm ``h``. ``vocab`` here is the HF size: vLLM pads it itself. MoE (no expert parallelism
    in vLLM): every expert on every rank, its intermediate dimension split over ``T``
    (``FusedMoE``): ``E·3·F_e/T × h``, the router ``E × h`` replicated, Qwen2-MoE's shared
    expert ``3·F_s/T × h`` and its gate ``h``.
    """
    t, h, d, f = rollout_tp, dims.hidden_size, dims.head_dim, dims.ffn_hidden_size
    q_rows = dims.num_attention_heads * d // t
    kv_rows = max(dims.num_query_groups // t, 1) * d
    layer = 2 * h + (q_rows + 2 * kv_rows) * h + h * q_rows
    if dims.is_moe:
        layer += dims.num_experts * (3 * (dims.moe_ffn_hidden_size // t) * h + h)
        if dims.moe_shared_expert_ffn_hidden_size:
            layer += 3 * (dims.moe_shared_expert_ffn_hidden_size // t) * h + h
    else:
        layer += 3 * (f // t) * h
    if dims.qkv_bias:
        layer += q_rows + 2 * kv_rows
    if dims.qk_norm:
        layer += 2 * d
    vocab_rows = -(-dims.vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING // t
    embeddings = vocab_rows * h * (1 if dims.tie_word_embeddings else 2)
    return itemsize * (dims.num_layers * layer + embeddings + h)


def mlp_width_per_token(dims: ModelDims) -> int:
    """The MLP intermediate width one token passes through: ``F`` (dense) or ``k·F_e + F_s``
    (MoE: its top-k experts and the shared expert)."""
    if not dims.is_moe:
        return dims.ffn_hidden_size
    return dims.moe_router_topk * dims.moe_ffn_hidden_size + dims.moe_shared_expert_ffn_hidden_size


def layer_experts_bytes(dims: ModelDims, itemsize: int = 2) -> int:
    """One MoE layer's experts, whole (``E·3·F_e·h·e``): the resharding executor moves a
    layer's experts as one module, one bucket however large (0 for a dense model)."""
    return itemsize * dims.num_experts * 3 * dims.moe_ffn_hidden_size * dims.hidden_size


def kv_bytes_per_token(dims: ModelDims, rollout_tp: int, itemsize: int = 2) -> int:
    """KV-cache bytes per token on one vLLM rank: ``2·L·max(nkv/T, 1)·d·e``."""
    return (
        2 * dims.num_layers * max(dims.num_query_groups // rollout_tp, 1) * dims.head_dim * itemsize
    )
