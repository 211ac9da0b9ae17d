"""Will a config fit? Per-GPU peaks of each phase of a step, and layouts that fit when it does not.

Pure arithmetic over the terms of :mod:`megarl.config.memory` and
:mod:`megarl.config.activations` (no processes, no tensors); used by ``megarl plan`` and by
``megarl config validate`` (which warns when a config does not fit).

Phases follow the trainer's order (``rollout → sleep → log-probs → update → sync``):

- **rollout**: vLLM awake with its whole pool, ``gpu_memory_utilization × G`` (weights,
  activations, KV cache; vLLM refuses to start unless that much is free), plus the training
  state that is not offloaded.
- **log-probs**: vLLM asleep (level 1: weights copied to host RAM, KV cache dropped; nothing
  left on the GPU, or the whole pool with ``free_cache_engine=false``); the resident training
  state, plus for the heaviest forward-only pass (old log-probs, reference, values) that model's
  offloaded parameters and its transient activations.
- **update**: the model being trained with all of its state on the GPU (parameters, gradients,
  main parameters, Adam) and its training activations, the others resident.
- **sync**: vLLM's weights woken up, the actor's parameters, one 1 GiB bucket and the largest
  TP all-gather (the padded embedding).

A phase FITS when its total is at most ``G − reserve``; the reserve (default 4 GiB) stands for the
CUDA context, NCCL buffers and allocator fragmentation, which this plan does not itemise.
Host RAM per node is the offloaded state plus vLLM's sleeping weights, for every GPU of the node.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from megarl.config.activations import (
    Impl,
    Recompute,
    forward_activations,
    training_activations,
)
from megarl.config.batch import BatchPlan, PassBatches, critic_enabled, ref_used
from megarl.config.memory import (
    GIB,
    ITEMSIZE,
    ModelState,
    OptimizerAssumptions,
    kv_bytes_per_token,
    model_state,
    vllm_weight_bytes,
)
from megarl.config.model_dims import ModelDims, padded_vocab_size
from megarl.config.schema import MegarlConfig, MegatronConfig
from megarl.parallel.layout import ParallelLayout

BUCKET_BYTES = 1 << 30
"""The resharding executor's bucket limit (``DEFAULT_BUCKET_BYTES``)."""
CUDA_GRAPH_BYTES = GIB // 2
"""vLLM's CUDA graphs when ``enforce_eager`` is false (an estimate; vLLM logs the real size)."""


@dataclass(frozen=True)
class Cluster:
    """The machines a config is planned for."""

    nodes: int
    gpus_per_node: int
    gpu_memory_gib: float = 80.0
    """Memory of one GPU (H100: 80)."""
    reserve_gib: float = 4.0
    """Kept free: CUDA context, NCCL buffers, fragmentation."""

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def gpu_bytes(self) -> int:
        return int(self.gpu_memory_gib * GIB)

    @property
    def usable_bytes(self) -> int:
        return int((self.gpu_memory_gib - self.reserve_gib) * GIB)


@dataclass(frozen=True)
class Term:
    """One line of a phase: what, how many bytes per GPU, and the formula."""

    name: str
    nbytes: int
    formula: str


@dataclass(frozen=True)
class Phase:
    name: str
    terms: tuple[Term, ...]

    @property
    def total(self) -> int:
        return sum(t.nbytes for t in self.terms)


@dataclass(frozen=True)
class MemoryPlan:
    """Per-GPU peaks of every phase for one config on one cluster."""

    cluster: Cluster
    layout: ParallelLayout
    phases: tuple[Phase, ...]
    host_ram_per_node: tuple[Term, ...]
    kv_cache: dict[str, float]
    """``bytes``, ``tokens``, ``sequences`` of the configured length that vLLM's cache holds."""
    assumptions: tuple[str, ...]

    @property
    def fits(self) -> bool:
        return all(self.phase_fits(p) for p in self.phases) and self.kv_cache["bytes"] > 0

    def phase_fits(self, phase: Phase) -> bool:
        return phase.total <= self.cluster.usable_bytes

    @property
    def peak(self) -> int:
        return max(p.total for p in self.phases)

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpu_memory_bytes": self.cluster.gpu_bytes,
            "reserve_bytes": self.cluster.gpu_bytes - self.cluster.usable_bytes,
            "usable_bytes": self.cluster.usable_bytes,
            "layout": {"tp": self.layout.tp, "pp": self.layout.pp, "vpp": self.layout.vpp},
            "fits": self.fits,
            "phases": [
                {
                    "name": p.name,
                    "total_bytes": p.total,
                    "fits": self.phase_fits(p),
                    "terms": [t.__dict__ for t in p.terms],
                }
                for p in self.phases
            ],
            "host_ram_per_node": [t.__dict__ for t in self.host_ram_per_node],
            "kv_cache": self.kv_cache,
            "assumptions": list(self.assumptions),
        }


@dataclass
class _Model:
    """One training model's state split into what offloading moves."""

    name: str
    state: ModelState
    offload: tuple[bool, bool, bool] = (False, False, False)
    """param_offload, grad_offload, optimizer_offload."""

    @property
    def resident(self) -> int:
        """Bytes that stay on the GPU while the model is idle."""
        s, (p, g, o) = self.state, self.offload
        return (
            (0 if p else s.params)
            + (0 if g else s.grads)
            + (0 if o else s.main_params + s.optimizer_states)
        )

    @property
    def offloaded(self) -> int:
        return self.state.total - self.resident


def _impl(cfg: MegarlConfig, meg: MegatronConfig) -> Impl:
    if meg.transformer_impl == "auto":
        return "transformer_engine" if cfg.trainer.device == "cuda" else "local"
    return meg.transformer_impl


def _assumptions(cfg: MegarlConfig, meg: MegatronConfig) -> OptimizerAssumptions:
    impl = _impl(cfg, meg)
    return OptimizerAssumptions(
        dtype=cfg.trainer.dtype,
        distributed_optimizer=meg.use_distributed_optimizer,
        adam="fused" if impl == "transformer_engine" else "torch",
        impl=impl,
    )


def _tokens(p: PassBatches, seq: int) -> tuple[int, int]:
    """(micro-batch sequences, sequence length) of a pass (a token budget: one packed row)."""
    if p.micro_batch_size is not None:
        return p.micro_batch_size, seq
    budget = p.max_token_len_per_gpu or seq
    return max(1, budget // seq), seq


def _models(cfg: MegarlConfig, dims: ModelDims, world: int) -> list[_Model]:
    arr = cfg.actor_rollout_ref
    layout = arr.actor.megatron.parallel_layout()
    out = []
    roles = [("actor", arr.actor.megatron, arr.actor.optim.optimizer)]
    if critic_enabled(cfg):
        roles.append(("critic", cfg.critic.megatron, cfg.critic.optim.optimizer))
    for role, meg, optimizer in roles:
        opt = _assumptions(cfg, meg)
        opt = OptimizerAssumptions(**{**opt.__dict__, "optimizer": optimizer})
        state = model_state(dims, layout, world, role, opt)  # type: ignore[arg-type]
        out.append(
            _Model(role, state, (meg.param_offload, meg.grad_offload, meg.optimizer_offload))
        )
    if ref_used(cfg):
        meg = arr.ref.megatron
        state = model_state(dims, layout, world, "ref", _assumptions(cfg, meg))
        out.append(_Model("ref", state, (meg.param_offload, True, True)))
    return out


def plan_memory(cfg: MegarlConfig, dims: ModelDims, cluster: Cluster) -> MemoryPlan:
    """The per-GPU memory plan of ``cfg`` (a validated config) on ``cluster``.

    Raises ``ConfigError`` (from :class:`BatchPlan`) when the batch sizes do not divide.
    """
    world = cluster.world
    arr = cfg.actor_rollout_ref
    layout = arr.actor.megatron.parallel_layout()
    batches = BatchPlan.from_config(cfg, world)
    seq = cfg.data.max_prompt_length + cfg.data.max_response_length
    models = {m.name: m for m in _models(cfg, dims, world)}
    resident = sum(m.resident for m in models.values())
    rollout, vllm, kv = _rollout_terms(cfg, dims, cluster, resident)
    asleep = (
        0
        if arr.rollout.free_cache_engine
        else int(arr.rollout.gpu_memory_utilization * cluster.gpu_bytes)
    )
    sleep_term = Term(
        "vLLM asleep", asleep, "0 (sleep level 1) or the pool (free_cache_engine=false)"
    )
    phases = [
        Phase("rollout", rollout),
        Phase("log-probs", (sleep_term, *_logprob_terms(cfg, dims, batches, models, seq))),
        Phase("update", (sleep_term, *_update_terms(cfg, dims, batches, models, seq))),
        Phase("sync", (sleep_term, *_sync_terms(cfg, dims, models, vllm))),
    ]
    per_gpu_host = sum(m.offloaded for m in models.values())
    host = (
        Term(
            "offloaded training state",
            per_gpu_host * cluster.gpus_per_node,
            "G_node × Σ offloaded (params, grads, main params, Adam) per GPU",
        ),
        Term(
            "vLLM weights asleep (level 1)",
            (vllm if arr.rollout.free_cache_engine else 0) * cluster.gpus_per_node,
            "G_node × vLLM weights per rank",
        ),
    )
    impl = _impl(cfg, arr.actor.megatron)
    notes = (
        (
            f"optimizer: {'TE FusedAdam' if impl == 'transformer_engine' else 'torch Adam'}, fp32 "
            "main params and moments; the precision-aware optimizer and store_param_remainders "
            "are not modelled"
        ),
        f"layer spec: {impl}; sequence length {seq} = max_prompt_length + max_response_length",
        f"gradient buffers in fp32 (grad_reduce_in_fp32), {'distributed' if arr.actor.megatron.use_distributed_optimizer else 'plain'} optimizer over DP {layout.data_parallel_size(world)}",
        f"reserve {cluster.reserve_gib:g} GiB per GPU for CUDA context, NCCL and fragmentation",
    )
    return MemoryPlan(cluster, layout, tuple(phases), host, kv, notes)


def _rollout_terms(cfg, dims, cluster, resident) -> tuple[tuple[Term, ...], int, dict]:
    r = cfg.actor_rollout_ref.rollout
    t, e = r.tensor_model_parallel_size, ITEMSIZE[cfg.trainer.dtype]
    pool = int(r.gpu_memory_utilization * cluster.gpu_bytes)
    weights = vllm_weight_bytes(dims, t, e)
    h, f, d = dims.hidden_size, dims.ffn_hidden_size, dims.head_dim
    per_token = e * (
        4 * h + (dims.num_attention_heads + 2 * dims.num_query_groups) * d // t + 3 * f // t
    )
    profile = r.max_num_batched_tokens * per_token + 4 * r.max_num_seqs * dims.vocab_size
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
    terms = (
        Term("vLLM pool", pool, "gpu_memory_utilization × G (weights + activations + KV cache)"),
        Term("training state resident", resident, "Σ models: state not offloaded"),
    )
    return terms, weights, cache


def _logprob_terms(cfg, dims, batches, models, seq) -> tuple[Term, ...]:
    layout = cfg.actor_rollout_ref.actor.megatron.parallel_layout()
    resident = sum(m.resident for m in models.values())
    passes = [("actor", batches.old_log_prob)]
    if "critic" in models and batches.values is not None:
        passes.append(("critic", batches.values))
    if "ref" in models and batches.ref_log_prob is not None:
        passes.append(("ref", batches.ref_log_prob))
    best: tuple[int, str, int, int] = (0, "", 0, 0)
    for name, p in passes:
        b, s = _tokens(p, seq)
        act = forward_activations(
            dims, layout, micro_batch=b, seq_len=s, dtype=cfg.trainer.dtype,
            impl=_impl(cfg, cfg.actor_rollout_ref.actor.megatron),
            role="critic" if name == "critic" else "actor",
        )  # fmt: skip
        m = models[name]
        load = m.state.params if m.offload[0] else 0
        if load + act.peak > best[0]:
            best = (load + act.peak, f"{p.name} (b={b}, s={s})", load, act.peak)
    return (
        Term("training state resident", resident, "Σ models: state not offloaded"),
        Term(f"params loaded for {best[1]}", best[2], "e·n if param_offload else 0"),
        Term(
            f"forward activations, {best[1]}", best[3], "one layer + logits + log-prob working set"
        ),
    )


def _update_terms(cfg, dims, batches, models, seq) -> tuple[Term, ...]:
    arr = cfg.actor_rollout_ref
    layout = arr.actor.megatron.parallel_layout()
    options = [("actor", batches.actor, arr.actor.megatron)]
    if "critic" in models and batches.critic is not None:
        options.append(("critic", batches.critic, cfg.critic.megatron))
    best: tuple[int, tuple[Term, ...]] = (-1, ())
    for name, p, meg in options:
        b, s = _tokens(p, seq)
        m = models[name]
        act = training_activations(
            dims, layout, micro_batch=b, seq_len=s, micro_batches=p.micro_batches_per_rank or 1,
            dtype=cfg.trainer.dtype, impl=_impl(cfg, meg), role=name,
            recompute=Recompute(meg.recompute_granularity, meg.recompute_method,
                                meg.recompute_num_layers),
        )  # fmt: skip
        others = sum(o.resident for o in models.values() if o is not m)
        terms = (
            Term(f"{name} params", m.state.params, "e·n_pad (e·n without distributed optimizer)"),
            Term(f"{name} gradient buffers", m.state.grads, "4·n_pad (grad_reduce_in_fp32)"),
            Term(f"{name} fp32 main params", m.state.main_params, "4·n/N (16-bit params)"),
            Term(f"{name} Adam moments", m.state.optimizer_states, "8·n/N"),
            Term(f"{name} saved activations (b={b}, s={s})", act.saved, "in-flight micro-batches × layers × bytes/token"),
            Term(f"{name} recompute + log-prob working set", act.working, "one recomputed group; e·b·s·V/t + 20·b·1024·V/t"),
            Term("other models resident", others, "Σ other models: state not offloaded"),
        )  # fmt: skip
        total = sum(t.nbytes for t in terms)
        if total > best[0]:
            best = (total, terms)
    return best[1]


def _sync_terms(cfg, dims, models, vllm) -> tuple[Term, ...]:
    layout = cfg.actor_rollout_ref.actor.megatron.parallel_layout()
    e = ITEMSIZE[cfg.trainer.dtype]
    actor = models["actor"]
    rest = actor.resident - (0 if actor.offload[0] else actor.state.params)
    gather = (
        padded_vocab_size(dims.vocab_size, layout.tp) * dims.hidden_size * e if layout.tp > 1 else 0
    )
    others = sum(m.resident for m in models.values() if m is not actor)
    return (
        Term("vLLM weights (awake)", vllm, "vLLM weights per rank"),
        Term("actor params", actor.state.params, "e·n_pad"),
        Term("actor state resident (besides params)", rest, "grads/optimizer not offloaded"),
        Term("sync bucket + TP all-gather", BUCKET_BYTES + gather, "1 GiB + V·h·e (TP > 1)"),
        Term("other models resident", others, "Σ other models: state not offloaded"),
    )


# ---------------------------------------------------------------------------------------------
# Search
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Proposal:
    """A layout and switches that fit, as the overrides that select them."""

    tp: int
    pp: int
    offload: bool
    recompute: bool
    bubble: float
    """Pipeline bubble fraction (p − 1)/(m + p − 1) of the actor update."""
    plan: MemoryPlan
    overrides: tuple[str, ...] = field(default=())

    @property
    def key(self) -> tuple:
        """Sort key: no offload first, TP inside a node, less bubble, no recompute, lower peak."""
        cross_node = self.tp > self.plan.cluster.gpus_per_node
        return (self.offload, cross_node, round(self.bubble, 6), self.recompute, self.plan.peak)


def _with(cfg: MegarlConfig, tp: int, pp: int, offload: bool, recompute: bool) -> tuple:
    """A copy of ``cfg`` with this layout and these switches on every model, and the overrides
    (only keys whose value changes) that select it."""
    new = copy.deepcopy(cfg)
    values: dict[str, Any] = {
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "virtual_pipeline_model_parallel_size": None,
        "use_distributed_optimizer": True,
        "param_offload": offload,
        "grad_offload": offload,
        "optimizer_offload": offload,
        "recompute_granularity": "full" if recompute else None,
        "recompute_method": "uniform" if recompute else None,
        "recompute_num_layers": 1 if recompute else None,
    }
    overrides = []
    for prefix, section in (("actor_rollout_ref.actor", "actor"), ("critic", "critic"),
                            ("actor_rollout_ref.ref", "ref")):  # fmt: skip
        old_meg = _megatron(cfg, section)
        meg = _megatron(new, section)
        for key, value in values.items():
            if getattr(old_meg, key) != value:
                setattr(meg, key, value)
                text = "null" if value is None else str(value).lower()
                overrides.append(f"{prefix}.megatron.{key}={text}")
    return new, tuple(overrides)


def _megatron(cfg: MegarlConfig, section: str) -> MegatronConfig:
    arr = cfg.actor_rollout_ref
    return {"actor": arr.actor.megatron, "critic": cfg.critic.megatron, "ref": arr.ref.megatron}[
        section
    ]


def search_layouts(
    cfg: MegarlConfig, dims: ModelDims, cluster: Cluster, *, limit: int = 5
) -> list[Proposal]:
    """The ``limit`` best layouts (TP × PP, distributed optimizer, no VPP) and switches (all
    offloads on/off, full recompute on/off) that fit, sorted by :attr:`Proposal.key`.

    A layout is legal by the one rule (:func:`megarl.parallel.layout.layout_problems`) and when
    the batch sizes divide over its DP size; rollout settings are kept as configured.
    """
    from megarl.config.errors import ConfigError
    from megarl.parallel.layout import layout_problems

    world = cluster.world
    found: list[Proposal] = []
    for tp in [n for n in range(1, world + 1) if world % n == 0]:
        for pp in [n for n in range(1, world // tp + 1) if (world // tp) % n == 0]:
            problems = layout_problems(
                ParallelLayout(tp, pp),
                num_attention_heads=dims.num_attention_heads,
                num_query_groups=dims.num_query_groups,
                num_layers=dims.num_layers,
                ffn_hidden_size=dims.ffn_hidden_size,
                head_dim=dims.head_dim,
            )
            if problems:
                continue
            for offload in (False, True):
                for recompute in (False, True):
                    candidate, overrides = _with(cfg, tp, pp, offload, recompute)
                    try:
                        plan = plan_memory(candidate, dims, cluster)
                        m = BatchPlan.from_config(candidate, world).actor.micro_batches_per_rank
                    except ConfigError:
                        continue
                    if plan.fits:
                        bubble = (pp - 1) / ((m or 1) + pp - 1)
                        found.append(Proposal(tp, pp, offload, recompute, bubble, plan, overrides))
    return sorted(found, key=lambda p: p.key)[:limit]


DEFAULT_GPU_MEMORY_GIB = 80.0
"""GPU memory ``megarl config validate`` assumes (H100-80GB); ``megarl plan --gpu-memory``."""


def memory_warnings(cfg: MegarlConfig, world: int) -> list[str]:
    """One warning when ``cfg`` (already valid) does not fit on 80 GiB GPUs; none on CPU or
    when the model's shape is unknown (no config.json, preset or complete architecture)."""
    from megarl.config.errors import ConfigError
    from megarl.config.model_presets import resolve_hf_config

    if cfg.trainer.device != "cuda":
        return []
    try:
        hf, _ = resolve_hf_config(cfg.actor_rollout_ref.model)
        dims = ModelDims.from_hf_config(hf)
    except (OSError, ValueError):
        return []
    gpus = cfg.trainer.n_gpus_per_node
    cluster = (
        Cluster(world // gpus, gpus, DEFAULT_GPU_MEMORY_GIB)
        if world % gpus == 0
        else Cluster(1, world, DEFAULT_GPU_MEMORY_GIB)
    )
    try:
        plan = plan_memory(cfg, dims, cluster)
    except ConfigError:
        return []
    if plan.fits:
        return []
    bad = [f"{p.name} {p.total / GIB:.1f} GiB" for p in plan.phases if not plan.phase_fits(p)]
    if plan.kv_cache["bytes"] <= 0:
        bad.append("rollout: no room left for vLLM's KV cache")
    return [
        (
            f"memory: does not fit on {DEFAULT_GPU_MEMORY_GIB:g} GiB GPUs ({cluster.usable_bytes / GIB:g} "
            f"GiB usable per GPU): {', '.join(bad)}; `megarl plan --config ...` shows the terms and "
            "layouts that fit"
        )
    ]
