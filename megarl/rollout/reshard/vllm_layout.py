"""vLLM's tensor-parallel layout: what one vLLM TP rank keeps and loads of each HF tensor.

Pure rules read from vLLM 0.32's weight loaders (``QKVParallelLinear``,
``MergedColumnParallelLinear``, ``RowParallelLinear``, ``VocabParallelEmbedding``): the
resharding plan sends each rank exactly the part :func:`rollout_slice` names, so these rules
must follow vLLM's. The multi-rank sync tests fill everything else with NaN before vLLM loads
it, so a rule that drifted from vLLM's shows as NaN log-probs.

With vLLM expert parallelism (``enable_expert_parallel``, one engine: EP size = TP size, EP rank
= TP rank, MoE TP 1) each rank holds a consecutive run of whole routed experts
(:func:`rollout_expert_range`, vLLM's "linear" placement) and its loader skips the others;
attention, embeddings, norms, the router and a shared expert keep the TP rules above.
"""

from __future__ import annotations

import re

from megarl.config.model_dims import ModelDims

__all__ = [
    "VLLM_VOCAB_PADDING",
    "rollout_expert_range",
    "rollout_shard_shape",
    "rollout_slice",
]

VLLM_VOCAB_PADDING = 64
"""vLLM pads vocab-parallel embeddings to a multiple of this many rows, then splits them
(``DEFAULT_VOCAB_PADDING_SIZE``)."""


_VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")
_DIM0_LEAVES = ("q_proj", "gate_proj", "up_proj", "w1", "w3")
"""Column-parallel in vLLM: dim-0 chunk ``r``. MoE experts' gate/up (Qwen3-MoE names, Mixtral's
``w1``/``w3``) too: ``FusedMoE`` splits each expert's intermediate dimension over its TP ranks
(``_load_w13``)."""
_DIM1_LEAVES = ("o_proj", "down_proj", "w2")
"""Row-parallel in vLLM: dim-1 chunk ``r`` (experts' down / ``w2``: ``FusedMoE._load_w2``)."""
_ROUTED_EXPERT = re.compile(
    r"^model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
    r"(?:gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$"
)
"""A routed expert's HF tensor (Qwen3-MoE / Qwen2-MoE, Mixtral); group 1 is its global index.
Qwen2-MoE's ``shared_expert.*`` does not match: vLLM splits it over TP like a dense MLP."""


def rollout_expert_range(num_experts: int, rollout_tp: int, rank: int) -> range:
    """Global indices of the routed experts vLLM EP rank ``rank`` of ``rollout_tp`` holds.

    vLLM 0.32's "linear" placement (``determine_expert_map``, the default): ranks below
    ``E % T`` hold one expert more, and each rank's experts follow the previous rank's.
    """
    if not 0 <= rank < rollout_tp:
        raise ValueError(f"rollout rank {rank} outside 0..{rollout_tp - 1}")
    base, rem = divmod(num_experts, rollout_tp)
    start = rank * base + min(rank, rem)
    return range(start, start + base + (rank < rem))


def _held_expert(hf_name: str, dims: ModelDims, rollout_tp: int, rank: int) -> bool | None:
    """Under vLLM EP: whether ``rank`` holds the routed expert ``hf_name`` (None: not one)."""
    m = _ROUTED_EXPERT.match(hf_name)
    if m is None:
        return None
    return int(m.group(1)) in rollout_expert_range(dims.num_experts, rollout_tp, rank)


def rollout_shard_shape(
    hf_name: str,
    shape: tuple[int, ...],
    dims: ModelDims,
    rollout_tp: int,
    *,
    rollout_ep: bool = False,
    rollout_rank: int = 0,
) -> tuple[int, ...]:
    """Shape vLLM keeps on TP rank ``rollout_rank`` for the HF tensor ``hf_name`` (for sizing
    only).

    Column-parallel q/gate/up split dim 0; k/v split by KV heads, one head per rank when
    ``rollout_tp`` exceeds them (replication); o/down split dim 1; embeddings are padded to a
    multiple of 64 rows and split evenly; norms are replicated. With ``rollout_ep`` a routed
    expert is whole on the rank holding it and has 0 rows elsewhere; the rank matters only then.
    """
    t = rollout_tp
    leaf = hf_name.split(".")[-2] if "." in hf_name else hf_name
    held = _held_expert(hf_name, dims, t, rollout_rank) if rollout_ep else None
    if held is not None:
        return shape if held else (0, *shape[1:])
    if hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
        # vLLM pads the vocabulary at every TP size, 1 included (VocabParallelEmbedding)
        padded = -(-shape[0] // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
        return (padded // t, *shape[1:])
    if t == 1:
        return shape
    if leaf in ("k_proj", "v_proj"):
        heads = max(dims.num_query_groups // t, 1)
        return (heads * dims.head_dim, *shape[1:])
    if leaf in _DIM0_LEAVES:
        return (shape[0] // t, *shape[1:])
    if leaf in _DIM1_LEAVES:
        return (shape[0], shape[1] // t)
    return shape


def rollout_slice(
    hf_name: str,
    shape: tuple[int, ...],
    dims: ModelDims,
    rollout_tp: int,
    rollout_rank: int,
    rollout_ep: bool = False,
) -> tuple[int, int, int] | None:
    """``(dim, start, stop)``: the part of the full HF tensor ``hf_name`` that vLLM's weight
    loader on TP rank ``rollout_rank`` of ``rollout_tp`` narrows out and copies (None: the
    whole tensor, which vLLM keeps replicated).

    vLLM 0.32's rules: ``q``/``gate``/``up`` (weights and biases) take dim-0 chunk ``r``; ``k``/
    ``v`` take KV-head chunk ``r // replicas`` (``replicas = TP // KV heads`` when TP exceeds the
    KV heads, so ranks sharing a head read the same rows); ``o``/``down`` take dim-1 chunk
    ``r``; the embedding and ``lm_head`` take rows ``[r·p, (r+1)·p)`` of the vocabulary padded
    to 64 (``p`` = padded / TP), clipped to the real rows (possibly empty); norms are whole.

    With ``rollout_ep`` (vLLM expert parallelism) a routed expert's tensor is whole (None) on
    the rank holding it (:func:`rollout_expert_range`) and the empty ``(0, 0, 0)`` elsewhere.
    """
    t, r = rollout_tp, rollout_rank
    if not 0 <= r < t:
        raise ValueError(f"rollout rank {r} outside 0..{t - 1}")
    held = _held_expert(hf_name, dims, t, r) if rollout_ep else None
    if held is not None:
        return None if held else (0, 0, 0)
    if hf_name in _VOCAB_TENSORS:
        per = -(-shape[0] // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING // t
        return 0, min(r * per, shape[0]), min((r + 1) * per, shape[0])
    if t == 1:
        return None
    leaf = hf_name.split(".")[-2] if "." in hf_name else hf_name
    if leaf in ("k_proj", "v_proj"):
        groups = dims.num_query_groups
        rows = max(groups // t, 1) * dims.head_dim
        shard = r // max(t // groups, 1)
        return 0, shard * rows, (shard + 1) * rows
    if leaf in _DIM0_LEAVES:
        rows = shape[0] // t
        return 0, r * rows, (r + 1) * rows
    if leaf in _DIM1_LEAVES:
        cols = shape[1] // t
        return 1, r * cols, (r + 1) * cols
    return None
