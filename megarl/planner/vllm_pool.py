"""What vLLM's memory pool on one GPU holds: the rollout engine's (``actor_rollout_ref.rollout``)
and the distillation teacher's on its own ranks (``distillation.teacher_models.*.inference``).

A pool is ``gpu_memory_utilization`` × G; vLLM's weights per rank, a prefill's activations (vLLM
profiles one of ``max_num_batched_tokens`` at start) and any CUDA graphs come out of it, and the
KV cache gets what is left. :mod:`megarl.planner.memory_plan` turns these into its phases.
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.config.batch_plan import teacher_inference, teacher_tp
from megarl.config.model_dims import ModelDims
from megarl.planner.memory import (
    GIB,
    ITEMSIZE,
    kv_bytes_per_token,
    mlp_width_per_token,
    vllm_weight_bytes,
)

CUDA_GRAPH_BYTES = GIB // 2
"""vLLM's CUDA graphs when ``enforce_eager`` is false (an estimate; vLLM logs the real size).
vLLM 0.32 captures them outside its sleep pool unless ``sleep_mode_offload_cudagraph`` is set
(``vllm/compilation/cudagraph_pool.py``): they stay on the GPU while vLLM sleeps, at any level."""


def prefill_bytes(dims: ModelDims, tp: int, itemsize: int, tokens: int) -> int:
    """A prefill of ``tokens`` tokens' activations on one rank of vLLM TP ``tp`` (one layer's
    hidden states, attention projections and MLP at a time)."""
    h, f, d = dims.hidden_size, mlp_width_per_token(dims), dims.head_dim
    per_token = itemsize * (
        4 * h + (dims.num_attention_heads + 2 * dims.num_query_groups) * d // tp + 3 * f // tp
    )
    return tokens * per_token


def rollout_pool(cfg, dims: ModelDims, gpu_bytes: int) -> tuple[int, int, dict]:
    """(vLLM's pool, its weights per rank, the KV cache it leaves) on one GPU."""
    r = cfg.actor_rollout_ref.rollout
    t, e = r.tensor_model_parallel_size, ITEMSIZE[cfg.trainer.dtype]
    pool = int(r.gpu_memory_utilization * gpu_bytes)
    weights = vllm_weight_bytes(dims, t, e)
    profile = prefill_bytes(dims, t, e, r.max_num_batched_tokens)
    profile += 4 * r.max_num_seqs * dims.vocab_size
    graphs = 0 if r.enforce_eager else CUDA_GRAPH_BYTES
    kv = pool - weights - profile - graphs
    kv_token = kv_bytes_per_token(dims, t, e)
    length = r.prompt_length + r.response_length
    cache = {
        "bytes": kv,
        "tokens": max(kv, 0) // kv_token,
        "sequences": max(kv, 0) // kv_token / length,
        "bytes_per_token": kv_token,
        "weights_bytes": weights,
        "activation_profile_bytes": profile,
        "cuda_graph_bytes": graphs,
    }
    return pool, weights, cache


@dataclass(frozen=True)
class TeacherPool:
    """The vLLM teacher's pool on one of its GPUs."""

    pool: int
    """``inference.gpu_memory_utilization`` × G."""
    weights: int
    """The teacher's weights per rank (its own shape, its TP)."""
    profile: int
    """A prefill of ``max_num_batched_tokens`` with the logits of every token (prompt log-probs)."""
    tp: int
    tokens: int
    """``inference.max_num_batched_tokens``."""

    @property
    def kv(self) -> int:
        """What is left for the KV cache (<= 0: vLLM cannot start)."""
        return self.pool - self.weights - self.profile


def teacher_pool(cfg, dims: ModelDims, gpu_bytes: int, spec=None) -> TeacherPool:
    """The distillation teacher's pool (``dims``: the teacher's shape; ``spec``: which teacher,
    a :class:`megarl.config.teachers.TeacherSpec`, default the first) on one of its GPUs."""
    inference = spec.inference if spec is not None else teacher_inference(cfg)
    t = spec.tp if spec is not None else teacher_tp(cfg)
    e = ITEMSIZE[cfg.trainer.dtype]
    tokens = int(inference.get("max_num_batched_tokens") or 8192)
    return TeacherPool(
        pool=int(float(inference.get("gpu_memory_utilization", 0.5)) * gpu_bytes),
        weights=vllm_weight_bytes(dims, t, e),
        profile=prefill_bytes(dims, t, e, tokens) + 4 * tokens * dims.vocab_size,
        tp=t,
        tokens=tokens,
    )
