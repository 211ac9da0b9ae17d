"""Hugging Face <-> Megatron-Core weight layout for the Llama / Qwen2 / Qwen3 family (dense; the
Qwen3-MoE / Mixtral MoE MLP through :mod:`megarl.models.moe_mapping`).

Pure tensor functions: no ``torch.distributed``, no Megatron imports. Everything works on *full*
(unsharded) Megatron tensors keyed by local-spec names with *global* layer indices
(``decoder.layers.{global_i}.…``). :func:`tp_split` / :func:`tp_merge` convert to and from
tensor-parallel shards, :func:`megatron_name_to_global` / :func:`megatron_name_to_local` to and
from per-stage (PP / VPP chunk) layer indices, :func:`to_te_name` / :func:`from_te_name` to and
from the Transformer Engine spec's names.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
from torch import Tensor

from megarl.config.model_dims import (
    SUPPORTED_ARCHITECTURES,
    ModelDims,
    UnsupportedArchitectureError,
    padded_vocab_size,
)
from megarl.models import moe_mapping as mm

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "ModelDims",
    "UnsupportedArchitectureError",
    "build_megatron_param",
    "fc1_to_gate_up",
    "from_te_name",
    "from_te_names",
    "gate_up_to_fc1",
    "hf_param_names",
    "hf_param_shape",
    "hf_to_megatron",
    "hf_to_megatron_param",
    "is_te_extra_state",
    "layer_index",
    "megatron_name_to_global",
    "megatron_name_to_local",
    "megatron_param_names",
    "megatron_param_shape",
    "megatron_param_sources",
    "megatron_param_to_hf",
    "megatron_to_hf",
    "megatron_to_hf_param",
    "padded_vocab_size",
    "qkv_megatron_to_separate",
    "qkv_separate_to_megatron",
    "to_te_name",
    "to_te_names",
    "tp_merge",
    "tp_partition_kind",
    "tp_shard_shape",
    "tp_split",
]

PartitionKind = Literal["column", "row", "fc1", "vocab", "replicated"]


# --------------------------------------------------------------------------------------------
# Names
# --------------------------------------------------------------------------------------------

_LAYER_RE = re.compile(r"^(decoder\.layers\.)(\d+)(\..+)$")

EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"
FINAL_NORM = "decoder.final_layernorm.weight"

# Megatron per-layer suffix -> (HF per-layer suffixes, partition kind). Multi-source entries are
# fused by the Megatron layout (qkv interleave, fc1 = [gate; up]).
_LAYER_MAP: dict[str, tuple[tuple[str, ...], PartitionKind]] = {
    "input_layernorm.weight": (("input_layernorm.weight",), "replicated"),
    "self_attention.linear_qkv.weight": (
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        "column",
    ),
    "self_attention.linear_qkv.bias": (
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
        "column",
    ),
    "self_attention.q_layernorm.weight": (("self_attn.q_norm.weight",), "replicated"),
    "self_attention.k_layernorm.weight": (("self_attn.k_norm.weight",), "replicated"),
    "self_attention.linear_proj.weight": (("self_attn.o_proj.weight",), "row"),
    "pre_mlp_layernorm.weight": (("post_attention_layernorm.weight",), "replicated"),
    "mlp.linear_fc1.weight": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), "fc1"),
    "mlp.linear_fc2.weight": (("mlp.down_proj.weight",), "row"),
}

# Local spec name -> Transformer Engine spec name (the norms fused into the following linear).
_TE_RENAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
}
_TE_RENAMES_INV = {v: k for k, v in _TE_RENAMES.items()}
_QK_NORMS = ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight")


def layer_index(mg_name: str) -> int | None:
    """Layer index in ``decoder.layers.{i}.…``, or None for non-layer parameters."""
    m = _LAYER_RE.match(mg_name)
    return int(m.group(2)) if m else None


def _shift_layer(mg_name: str, delta: int) -> str:
    m = _LAYER_RE.match(mg_name)
    if m is None:
        return mg_name
    new = int(m.group(2)) + delta
    if new < 0:
        raise ValueError(f"{mg_name}: layer index would become {new}")
    return f"{m.group(1)}{new}{m.group(3)}"


def megatron_name_to_global(local_name: str, layer_offset: int) -> str:
    """``decoder.layers.{i}.x`` -> ``decoder.layers.{i + layer_offset}.x`` (others unchanged).

    ``layer_offset`` is the global index of the first layer of this PP stage / VPP chunk.
    """
    return _shift_layer(local_name, layer_offset)


def megatron_name_to_local(global_name: str, layer_offset: int) -> str:
    """Inverse of :func:`megatron_name_to_global`."""
    return _shift_layer(global_name, -layer_offset)


def is_te_extra_state(mg_name: str) -> bool:
    """Transformer Engine's ``*._extra_state`` buffers (FP8 metadata), not weights."""
    return mg_name.endswith("._extra_state")


def to_te_name(mg_name: str, *, moe: bool = False) -> str:
    """Local-spec Megatron name -> Transformer Engine spec name (``moe``: a MoE model, whose
    ``pre_mlp_layernorm`` stays a module of its own and whose experts are grouped)."""
    m = _LAYER_RE.match(mg_name)
    if m is None:
        return mg_name
    suffix = m.group(3)[1:]
    if moe and suffix.startswith("pre_mlp_layernorm."):
        return mg_name
    if suffix in _TE_RENAMES:
        return f"{m.group(1)}{m.group(2)}.{_TE_RENAMES[suffix]}"
    return f"{m.group(1)}{m.group(2)}.{mm.to_te_expert_suffix(suffix)}"


def from_te_name(mg_name: str) -> str:
    """Transformer Engine spec name -> local-spec Megatron name (identity for local names)."""
    m = _LAYER_RE.match(mg_name)
    if m is None:
        return mg_name
    suffix = m.group(3)[1:]
    if suffix in _TE_RENAMES_INV:
        return f"{m.group(1)}{m.group(2)}.{_TE_RENAMES_INV[suffix]}"
    return f"{m.group(1)}{m.group(2)}.{mm.from_te_expert_suffix(suffix)}"


def to_te_names(sd: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Rename a local-spec state dict to TE-spec names (no ``_extra_state`` is added)."""
    return {to_te_name(k): v for k, v in sd.items()}


def from_te_names(sd: Mapping[str, Any]) -> dict[str, Any]:
    """Rename a TE-spec state dict to local-spec names, dropping ``*._extra_state`` entries."""
    return {from_te_name(k): v for k, v in sd.items() if not is_te_extra_state(k)}


def _split_name(mg_name: str) -> tuple[int | None, str]:
    """(global layer index or None, canonical local-spec suffix / top-level name)."""
    name = from_te_name(mg_name)
    m = _LAYER_RE.match(name)
    if m:
        suffix = m.group(3)[1:]
        if suffix not in _LAYER_MAP and not mm.is_moe_suffix(suffix):
            raise KeyError(f"unknown Megatron parameter {mg_name!r}")
        return int(m.group(2)), suffix
    if name not in (EMBEDDING, OUTPUT_LAYER, FINAL_NORM):
        raise KeyError(f"unknown Megatron parameter {mg_name!r}")
    return None, name


def _layer_entry(suffix: str, dims: ModelDims) -> tuple[tuple[str, ...], PartitionKind]:
    """(HF per-layer suffixes, TP partition kind) of a per-layer Megatron suffix."""
    if suffix in _LAYER_MAP:
        return _LAYER_MAP[suffix]
    return mm.moe_sources(suffix, dims)


def _layer_suffixes(dims: ModelDims) -> list[str]:
    """Megatron suffixes of one layer, in Megatron's order (MoE: router and experts as MLP)."""
    out: list[str] = []
    for suffix in _LAYER_MAP:
        if suffix == "self_attention.linear_qkv.bias" and not dims.qkv_bias:
            continue
        if suffix in _QK_NORMS and not dims.qk_norm:
            continue
        if dims.is_moe and suffix.startswith("mlp."):
            continue
        out.append(suffix)
    return out + (mm.moe_layer_suffixes(dims) if dims.is_moe else [])


def megatron_param_names(dims: ModelDims, *, include_tied_output: bool = False) -> list[str]:
    """All full Megatron (local-spec) parameter names with global layer (and expert) indices.

    With tied embeddings ``output_layer.weight`` is only listed if ``include_tied_output`` (the
    last PP stage holds a copy of the embedding under that name when PP > 1).
    """
    names = [EMBEDDING]
    suffixes = _layer_suffixes(dims)
    for i in range(dims.num_layers):
        names += [f"decoder.layers.{i}.{suffix}" for suffix in suffixes]
    names.append(FINAL_NORM)
    if not dims.tie_word_embeddings or include_tied_output:
        names.append(OUTPUT_LAYER)
    return names


def hf_param_names(dims: ModelDims) -> list[str]:
    """All HF parameter names of the model (no ``lm_head.weight`` when tied)."""
    names: list[str] = []
    for mg_name in megatron_param_names(dims):
        names.extend(megatron_param_sources(mg_name, dims))
    return names


def hf_param_shape(hf_name: str, dims: ModelDims) -> tuple[int, ...]:
    """Shape of the HF tensor ``hf_name``."""
    h, f, d = dims.hidden_size, dims.ffn_hidden_size, dims.head_dim
    q, kv = dims.num_attention_heads * d, dims.num_query_groups * d
    if hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
        return (dims.vocab_size, h)
    if hf_name == "model.norm.weight":
        return (h,)
    m = re.match(r"^model\.layers\.\d+\.(.+)$", hf_name)
    shapes: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.bias": (kv,),
        "self_attn.q_norm.weight": (d,),
        "self_attn.k_norm.weight": (d,),
        "self_attn.o_proj.weight": (h, q),
        "mlp.gate_proj.weight": (f, h),
        "mlp.up_proj.weight": (f, h),
        "mlp.down_proj.weight": (h, f),
    }
    moe_shape = mm.moe_hf_shape(m.group(1), dims) if m is not None and dims.is_moe else None
    if moe_shape is not None:
        return moe_shape
    if m is None or m.group(1) not in shapes:
        raise KeyError(f"unknown HF parameter {hf_name!r}")
    return shapes[m.group(1)]


def megatron_param_sources(mg_name: str, dims: ModelDims) -> list[str]:
    """HF tensor names needed to build the full Megatron parameter ``mg_name`` (global index).

    A tied ``output_layer.weight`` is built from ``model.embed_tokens.weight``.
    """
    layer, suffix = _split_name(mg_name)
    if layer is None:
        if suffix == EMBEDDING:
            return ["model.embed_tokens.weight"]
        if suffix == FINAL_NORM:
            return ["model.norm.weight"]
        return ["model.embed_tokens.weight" if dims.tie_word_embeddings else "lm_head.weight"]
    return [f"model.layers.{layer}.{s}" for s in _layer_entry(suffix, dims)[0]]


def megatron_param_shape(mg_name: str, dims: ModelDims) -> tuple[int, ...]:
    """Shape of the full (unsharded) Megatron parameter."""
    _, suffix = _split_name(mg_name)
    h, f, d = dims.hidden_size, dims.ffn_hidden_size, dims.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        EMBEDDING: (dims.padded_vocab_size, h),
        OUTPUT_LAYER: (dims.padded_vocab_size, h),
        FINAL_NORM: (h,),
        "input_layernorm.weight": (h,),
        "self_attention.linear_qkv.weight": (dims.qkv_rows, h),
        "self_attention.linear_qkv.bias": (dims.qkv_rows,),
        "self_attention.q_layernorm.weight": (d,),
        "self_attention.k_layernorm.weight": (d,),
        "self_attention.linear_proj.weight": (h, dims.num_attention_heads * d),
        "pre_mlp_layernorm.weight": (h,),
        "mlp.linear_fc1.weight": (2 * f, h),
        "mlp.linear_fc2.weight": (h, f),
    }
    if suffix not in shapes:
        return mm.moe_megatron_shape(suffix, dims)
    return shapes[suffix]


# --------------------------------------------------------------------------------------------
# Fused-layout helpers
# --------------------------------------------------------------------------------------------


def qkv_separate_to_megatron(q: Tensor, k: Tensor, v: Tensor, dims: ModelDims) -> Tensor:
    """HF q/k/v (weights ``[n·d, H]`` or biases ``[n·d]``) -> Megatron interleaved ``linear_qkv``.

    Megatron's rows are interleaved per KV group ``g``: ``[q heads of g (nq/nkv heads × d rows);
    k_g (d rows); v_g (d rows)]``.
    Works on a whole model or on a TP slice of whole groups: the number of groups is read from
    ``k`` (``k.shape[0] // head_dim``).
    """
    d = dims.head_dim
    groups = k.shape[0] // d
    rest = q.shape[1:]
    qg = q.reshape(groups, dims.heads_per_group * d, *rest)
    kg = k.reshape(groups, d, *rest)
    vg = v.reshape(groups, d, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *rest)


def qkv_megatron_to_separate(qkv: Tensor, dims: ModelDims) -> tuple[Tensor, Tensor, Tensor]:
    """Megatron interleaved ``linear_qkv`` weight or bias -> HF (q, k, v).

    Accepts the full tensor or one TP shard holding whole groups (TP divides
    ``num_query_groups``); the group count is inferred from ``qkv.shape[0]``. Returns contiguous
    tensors.
    """
    d = dims.head_dim
    per_group = (dims.heads_per_group + 2) * d
    if qkv.shape[0] % per_group:
        raise ValueError(f"linear_qkv with {qkv.shape[0]} rows is not whole groups of {per_group}")
    groups = qkv.shape[0] // per_group
    rest = qkv.shape[1:]
    g = qkv.reshape(groups, per_group, *rest)
    qd = dims.heads_per_group * d
    q = g[:, :qd].reshape(-1, *rest).contiguous()
    k = g[:, qd : qd + d].reshape(-1, *rest).contiguous()
    v = g[:, qd + d :].reshape(-1, *rest).contiguous()
    return q, k, v


def gate_up_to_fc1(gate: Tensor, up: Tensor) -> Tensor:
    """HF gate/up -> Megatron ``linear_fc1`` (``[gate; up]``; also one TP rank's shard form)."""
    return torch.cat([gate, up], dim=0)


def fc1_to_gate_up(fc1: Tensor) -> tuple[Tensor, Tensor]:
    """Megatron ``linear_fc1`` (full or one TP shard) -> (gate, up)."""
    gate, up = torch.chunk(fc1, 2, dim=0)
    return gate.contiguous(), up.contiguous()


def _pad_vocab(t: Tensor, dims: ModelDims) -> Tensor:
    if t.shape[0] > dims.padded_vocab_size:
        raise ValueError(f"vocab rows {t.shape[0]} > padded_vocab_size {dims.padded_vocab_size}")
    pad = dims.padded_vocab_size - t.shape[0]
    if pad == 0:
        return t
    return torch.cat([t, t.new_zeros(pad, *t.shape[1:])], dim=0)


# --------------------------------------------------------------------------------------------
# Per-parameter conversion
# --------------------------------------------------------------------------------------------


def build_megatron_param(mg_name: str, hf_tensors: Mapping[str, Tensor], dims: ModelDims) -> Tensor:
    """Build one full Megatron parameter from the HF tensors named by :func:`megatron_param_sources`."""
    return hf_to_megatron_param(mg_name, hf_tensors.__getitem__, dims)


def hf_to_megatron_param(
    mg_name: str, hf_getter: Callable[[str], Tensor], dims: ModelDims
) -> Tensor:
    """Build one full Megatron parameter, reading HF tensors lazily via ``hf_getter(hf_name)``."""
    _, suffix = _split_name(mg_name)
    names = megatron_param_sources(mg_name, dims)
    srcs = [hf_getter(n) for n in names]
    if suffix in (EMBEDDING, OUTPUT_LAYER) and srcs[0].shape[0] != dims.vocab_size:
        raise ValueError(f"{names[0]}: {srcs[0].shape[0]} rows != vocab_size {dims.vocab_size}")
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        out = qkv_separate_to_megatron(*srcs, dims)
    elif _kind(suffix) == "fc1":
        out = gate_up_to_fc1(*srcs)
    elif suffix in (EMBEDDING, OUTPUT_LAYER):
        out = _pad_vocab(srcs[0], dims)
    else:
        (out,) = srcs
    expected = megatron_param_shape(mg_name, dims)
    if tuple(out.shape) != expected:
        raise ValueError(
            f"{mg_name}: built shape {tuple(out.shape)} from {names}, expected {expected}"
        )
    return out


def megatron_param_to_hf(mg_name: str, full: Tensor, dims: ModelDims) -> dict[str, Tensor]:
    """One full Megatron parameter (local or TE name, global index) -> HF-named tensors.

    Vocab padding is trimmed. A tied ``output_layer.weight`` maps to nothing (the embedding
    carries it).
    """
    _, suffix = _split_name(mg_name)
    if suffix == OUTPUT_LAYER and dims.tie_word_embeddings:
        return {}
    names = megatron_param_sources(mg_name, dims)
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        parts: tuple[Tensor, ...] = qkv_megatron_to_separate(full, dims)
    elif _kind(suffix) == "fc1":
        parts = fc1_to_gate_up(full)
    elif suffix in (EMBEDDING, OUTPUT_LAYER):
        if full.shape[0] < dims.vocab_size:
            raise ValueError(f"{mg_name}: {full.shape[0]} rows < vocab_size {dims.vocab_size}")
        parts = (full[: dims.vocab_size],)
    else:
        parts = (full,)
    return dict(zip(names, parts, strict=True))


megatron_to_hf_param = megatron_param_to_hf
"""Alias of :func:`megatron_param_to_hf` (the name the rollout resharder uses)."""


# --------------------------------------------------------------------------------------------
# Whole-model conversion
# --------------------------------------------------------------------------------------------

_HF_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def hf_to_megatron(hf_state: Mapping[str, Tensor], dims: ModelDims) -> dict[str, Tensor]:
    """Full HF state dict -> full Megatron state dict (local-spec names, global layer indices).

    Embedding / output layer are zero-padded to ``dims.padded_vocab_size``. With tied embeddings
    no ``output_layer.weight`` is produced (use :func:`hf_to_megatron_param` for the PP copy).
    Raises ``ValueError`` if ``hf_state`` has tensors this mapping would silently drop.
    """
    out: dict[str, Tensor] = {}
    used: set[str] = set()
    for mg_name in megatron_param_names(dims):
        used.update(megatron_param_sources(mg_name, dims))
        out[mg_name] = hf_to_megatron_param(mg_name, hf_state.__getitem__, dims)
    if dims.tie_word_embeddings:
        used.add("lm_head.weight")  # HF may serialise the tied copy
    unused = sorted(k for k in hf_state if k not in used and not _HF_IGNORED.search(k))
    if unused:
        raise ValueError(f"HF tensors not mapped for {dims.architecture}: {unused[:8]}")
    return out


def megatron_to_hf(mg_state: Mapping[str, Tensor], dims: ModelDims) -> dict[str, Tensor]:
    """Full Megatron state dict (local or TE names, global indices) -> HF state dict.

    Trims vocab padding; with tied embeddings produces no ``lm_head.weight`` and ignores any
    ``output_layer.weight``. TE ``_extra_state`` entries are ignored.
    """
    out: dict[str, Tensor] = {}
    for name, tensor in mg_state.items():
        if is_te_extra_state(name):
            continue
        out.update(megatron_param_to_hf(name, tensor, dims))
    missing = [n for n in hf_param_names(dims) if n not in out]
    if missing:
        raise ValueError(f"Megatron state is missing parameters for HF tensors {missing[:8]}")
    return out


# --------------------------------------------------------------------------------------------
# Tensor parallelism
# --------------------------------------------------------------------------------------------


def tp_partition_kind(mg_name: str) -> PartitionKind:
    """How ``mg_name`` is split across TP ranks.

    ``column``: contiguous dim-0 chunk (``linear_qkv`` = whole KV groups); ``row``: dim-1 chunk;
    ``fc1``: ``[gate chunk; up chunk]``; ``vocab``: dim-0 chunk of the padded vocab;
    ``replicated``: every rank holds the full tensor (norms).
    """
    _, suffix = _split_name(mg_name)
    if suffix in (EMBEDDING, OUTPUT_LAYER):
        return "vocab"
    if suffix == FINAL_NORM:
        return "replicated"
    return _kind(suffix)


def _kind(suffix: str) -> PartitionKind:
    """Partition kind of a layer suffix (or a top-level name: replicated), read off the name."""
    if suffix in _LAYER_MAP:
        return _LAYER_MAP[suffix][1]
    if suffix == mm.ROUTER:
        return "replicated"
    if suffix in mm.SHARED:
        return mm.SHARED[suffix][1]  # type: ignore[return-value]
    expert = mm.expert_of(suffix)
    if expert is not None:
        return "fc1" if expert[1] == "linear_fc1" else "row"
    return "replicated"


def _check_divisible(mg_name: str, what: str, n: int, tp_size: int) -> None:
    if n % tp_size:
        raise ValueError(f"{mg_name}: {what}={n} is not divisible by TP={tp_size}")


def tp_split(mg_name: str, full: Tensor, tp_size: int, tp_rank: int, dims: ModelDims) -> Tensor:
    """TP rank ``tp_rank``'s shard of the full Megatron parameter ``mg_name``.

    Column-parallel (``linear_qkv``: a contiguous dim-0 chunk of the interleaved tensor) and
    vocab-parallel (word embeddings, output layer: padded with zero rows to
    ``padded_vocab_size``, a multiple of ``make_vocab_size_divisible_by × TP``) split dim 0;
    row-parallel (``linear_proj``, ``linear_fc2``) dim 1; ``linear_fc1`` ``[gate; up]`` gives
    rank ``r`` ``[gate_r; up_r]``.
    Returns a view where possible (replicated parameters return ``full`` itself); copy before
    writing into it.
    """
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank={tp_rank} out of range for TP={tp_size}")
    kind = tp_partition_kind(mg_name)
    if kind == "replicated" or tp_size == 1:
        return full
    if kind == "column":
        # linear_qkv is a plain ColumnParallelLinear: an even dim-0 chunk of the interleaved
        # tensor. With TP dividing num_query_groups that is whole groups; Megatron-Core 0.16 also
        # allows TP a multiple of num_query_groups (a rank then holds part of one group and
        # all-gathers activations), which the same chunking covers.
        groups = dims.num_query_groups
        if groups % tp_size and tp_size % groups:
            raise ValueError(
                f"{mg_name}: num_query_groups={groups} must be a multiple or divisor of TP={tp_size}"
            )
        _check_divisible(mg_name, "num_attention_heads", dims.num_attention_heads, tp_size)
        return torch.chunk(full, tp_size, dim=0)[tp_rank]
    if kind == "vocab":
        _check_divisible(mg_name, "vocab rows", full.shape[0], tp_size)
        return torch.chunk(full, tp_size, dim=0)[tp_rank]
    if kind == "row":
        _check_divisible(mg_name, "input dim", full.shape[1], tp_size)
        return torch.chunk(full, tp_size, dim=1)[tp_rank]
    gate, up = torch.chunk(full, 2, dim=0)
    _check_divisible(mg_name, "ffn_hidden_size", gate.shape[0], tp_size)
    return torch.cat(
        [torch.chunk(gate, tp_size, dim=0)[tp_rank], torch.chunk(up, tp_size, dim=0)[tp_rank]]
    )


def tp_shard_shape(mg_name: str, shape: tuple[int, ...], tp_size: int) -> tuple[int, ...]:
    """Shape of one TP rank's :func:`tp_split` shard of the full ``mg_name`` of ``shape``."""
    kind = tp_partition_kind(mg_name)
    if kind == "replicated" or tp_size == 1:
        return shape
    if kind == "row":
        return (shape[0], shape[1] // tp_size)
    return (shape[0] // tp_size, *shape[1:])  # column, vocab, fc1 (a gate and an up chunk)


def tp_merge(mg_name: str, shards: list[Tensor], dims: ModelDims) -> Tensor:
    """Inverse of :func:`tp_split`: the full parameter from all TP ranks' shards (rank order)."""
    if not shards:
        raise ValueError(f"{mg_name}: no shards")
    kind = tp_partition_kind(mg_name)
    if kind == "replicated" or len(shards) == 1:
        return shards[0]
    if kind in ("column", "vocab"):
        return torch.cat(shards, dim=0)
    if kind == "row":
        return torch.cat(shards, dim=1)
    gates, ups = zip(*(torch.chunk(s, 2, dim=0) for s in shards), strict=True)
    return torch.cat([*gates, *ups], dim=0)
