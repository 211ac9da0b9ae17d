"""Hugging Face <-> Megatron-Core names and shapes of the MoE MLP (Qwen3-MoE, Qwen2-MoE, Mixtral).

Pure functions used by :mod:`megarl.models.hf_mapping` for each MoE layer's MLP; attention, norms
and embeddings of these families are the dense mapping. Megatron names (local spec,
``SequentialMLP``) carry *global* expert indices, ``mlp.experts.local_experts.{e}``
(:func:`expert_name_to_global` / :func:`expert_name_to_local` translate an expert-parallel
rank's own). The router is replicated; each expert's ``linear_fc1`` ``[gate_e; up_e]`` and
``linear_fc2`` are split over *expert* TP like a dense MLP's. HF names are the safetensors ones
(as on the Hub and as vLLM loads them; transformers 5 fuses experts into 3-D tensors only in
memory).
"""

from __future__ import annotations

import re
from typing import Literal

from megarl.config.model_dims import ModelDims

PartitionKind = Literal["fc1", "row", "replicated"]

ROUTER = "mlp.router.weight"
SHARED = {  # Qwen2-MoE's shared expert (TP-split like a dense MLP) and its sigmoid gate
    "mlp.shared_experts.linear_fc1.weight": (
        ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"),
        "fc1",
    ),
    "mlp.shared_experts.linear_fc2.weight": (("mlp.shared_expert.down_proj.weight",), "row"),
    "mlp.shared_experts.gate_weight": (("mlp.shared_expert_gate.weight",), "replicated"),
}
_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
_TE_EXPERT_RE = re.compile(r"^mlp\.experts\.(linear_fc1|linear_fc2)\.weight(\d+)$")
_LAYER_PREFIX = re.compile(r"^(decoder\.layers\.\d+\.)(.+)$")

# family -> (router, gate, up, down) HF suffixes; "{e}" is the global expert index.
_HF_NAMES = {
    "Qwen3MoeForCausalLM": (
        "mlp.gate.weight",
        "mlp.experts.{e}.gate_proj.weight",
        "mlp.experts.{e}.up_proj.weight",
        "mlp.experts.{e}.down_proj.weight",
    ),
    "Qwen2MoeForCausalLM": (
        "mlp.gate.weight",
        "mlp.experts.{e}.gate_proj.weight",
        "mlp.experts.{e}.up_proj.weight",
        "mlp.experts.{e}.down_proj.weight",
    ),
    "MixtralForCausalLM": (
        "block_sparse_moe.gate.weight",
        "block_sparse_moe.experts.{e}.w1.weight",
        "block_sparse_moe.experts.{e}.w3.weight",
        "block_sparse_moe.experts.{e}.w2.weight",
    ),
}


def _hf_names(dims: ModelDims) -> tuple[str, str, str, str]:
    return _HF_NAMES[dims.architecture]


def is_moe_suffix(suffix: str) -> bool:
    """Whether a per-layer Megatron suffix (``mlp.…``) belongs to the MoE MLP."""
    return suffix == ROUTER or suffix in SHARED or _EXPERT_RE.match(suffix) is not None


def expert_of(suffix: str) -> tuple[int, str] | None:
    """(expert index, ``linear_fc1``/``linear_fc2``) of an expert weight suffix, else None."""
    m = _EXPERT_RE.match(suffix)
    return (int(m.group(1)), m.group(2)) if m else None


def is_expert_param(mg_name: str) -> bool:
    """Whether a (layer-prefixed) Megatron name is an expert weight (split over EP and ETP)."""
    return expert_of_param(mg_name) is not None


def expert_of_param(mg_name: str) -> tuple[int, str] | None:
    """:func:`expert_of` for a layer-prefixed Megatron name (``decoder.layers.{l}.mlp…``)."""
    m = _LAYER_PREFIX.match(mg_name)
    return expert_of(m.group(2)) if m else None


def moe_layer_suffixes(dims: ModelDims) -> list[str]:
    """Megatron suffixes of one MoE layer's MLP, global expert order."""
    names = [ROUTER]
    if dims.moe_shared_expert_ffn_hidden_size:
        names += list(SHARED)
    for e in range(dims.num_experts):
        names += [
            f"mlp.experts.local_experts.{e}.linear_fc1.weight",
            f"mlp.experts.local_experts.{e}.linear_fc2.weight",
        ]
    return names


def moe_sources(suffix: str, dims: ModelDims) -> tuple[tuple[str, ...], PartitionKind]:
    """(HF per-layer suffixes, partition kind over expert TP) of a MoE MLP suffix.

    Raises ``KeyError`` for an unknown suffix or an expert index past ``num_experts``.
    """
    router, gate, up, down = _hf_names(dims)
    if suffix == ROUTER:
        return (router,), "replicated"
    if suffix in SHARED and dims.moe_shared_expert_ffn_hidden_size:
        return SHARED[suffix]  # type: ignore[return-value]
    found = expert_of(suffix)
    if found is None or found[0] >= dims.num_experts:
        raise KeyError(f"unknown Megatron MoE parameter {suffix!r}")
    e, which = found
    if which == "linear_fc1":
        return (gate.format(e=e), up.format(e=e)), "fc1"
    return (down.format(e=e),), "row"


def moe_megatron_shape(suffix: str, dims: ModelDims) -> tuple[int, ...]:
    h, f, fs = dims.hidden_size, dims.moe_ffn_hidden_size, dims.moe_shared_expert_ffn_hidden_size
    if suffix == ROUTER:
        return (dims.num_experts, h)
    shared = {
        "mlp.shared_experts.linear_fc1.weight": (2 * fs, h),
        "mlp.shared_experts.linear_fc2.weight": (h, fs),
        "mlp.shared_experts.gate_weight": (1, h),
    }
    if suffix in shared:
        return shared[suffix]
    _, which = expert_of(suffix) or (None, None)
    if which == "linear_fc1":
        return (2 * f, h)
    if which == "linear_fc2":
        return (h, f)
    raise KeyError(f"unknown Megatron MoE parameter {suffix!r}")


def moe_hf_shape(hf_suffix: str, dims: ModelDims) -> tuple[int, ...] | None:
    """Shape of a per-layer HF MoE tensor, None if ``hf_suffix`` is not one."""
    h, f = dims.hidden_size, dims.moe_ffn_hidden_size
    router, gate, up, down = _hf_names(dims)
    if hf_suffix == router:
        return (dims.num_experts, h)
    fs = dims.moe_shared_expert_ffn_hidden_size
    shared = {
        "mlp.shared_expert.gate_proj.weight": (fs, h),
        "mlp.shared_expert.up_proj.weight": (fs, h),
        "mlp.shared_expert.down_proj.weight": (h, fs),
        "mlp.shared_expert_gate.weight": (1, h),
    }
    if fs and hf_suffix in shared:
        return shared[hf_suffix]
    for pattern, shape in ((gate, (f, h)), (up, (f, h)), (down, (h, f))):
        regex = re.escape(pattern).replace(r"\{e\}", r"(\d+)")
        m = re.fullmatch(regex, hf_suffix)
        if m and int(m.group(1)) < dims.num_experts:
            return shape
    return None


def _renumber(mg_name: str, convert) -> str:
    m = _LAYER_PREFIX.match(mg_name)
    if m is None:
        return mg_name
    e = _EXPERT_RE.match(m.group(2))
    if e is None:
        return mg_name
    return f"{m.group(1)}mlp.experts.local_experts.{convert(int(e.group(1)))}.{e.group(2)}.weight"


def expert_name_to_global(local_name: str, ep_rank: int, num_local_experts: int) -> str:
    """``…local_experts.{j}…`` on expert-parallel rank ``ep_rank`` -> the global expert index
    ``ep_rank · num_local_experts + j`` (other names unchanged)."""
    return _renumber(local_name, lambda j: ep_rank * num_local_experts + j)


def expert_name_to_local(global_name: str, ep_rank: int, num_local_experts: int) -> str:
    """Inverse of :func:`expert_name_to_global` (ValueError for another rank's expert)."""

    def local(e: int) -> int:
        j = e - ep_rank * num_local_experts
        if not 0 <= j < num_local_experts:
            raise ValueError(f"{global_name}: expert {e} is not on expert-parallel rank {ep_rank}")
        return j

    return _renumber(global_name, local)


def from_te_expert_suffix(suffix: str) -> str:
    """``mlp.experts.linear_fc1.weight{j}`` (TEGroupedMLP) -> the local-spec suffix."""
    m = _TE_EXPERT_RE.match(suffix)
    return f"mlp.experts.local_experts.{m.group(2)}.{m.group(1)}.weight" if m else suffix


def to_te_expert_suffix(suffix: str) -> str:
    """Inverse of :func:`from_te_expert_suffix`."""
    m = _EXPERT_RE.match(suffix)
    return f"mlp.experts.{m.group(2)}.weight{m.group(1)}" if m else suffix
