"""Will a config fit? The per-GPU peak of every phase of a step (:func:`plan_memory`), and the
one-line warning of validation when it does not (:func:`memory_warnings`).

Each phase sums the state its residency keeps on the device (:mod:`megarl.planner.residency`,
the schedule the trainer applies) and that phase's transient memory, term by term with the
formula; NCCL's communicators and what a sleeping vLLM keeps are terms of every phase. A phase
fits when its total is at most the GPU memory less a reserve (default 4 GiB) for what the plan
does not itemise: the CUDA context and allocator fragmentation. The GPU memory is the device's
own total where CUDA runs (:func:`gpu_memory_gib`), else an H100's as CUDA reports it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from megarl.config.batch_plan import (
    BatchPlan,
    PassBatches,
    critic_enabled,
    ref_used,
    rollout_ranks,
    stages_weight_updates,
    teacher_ranks,
    teacher_used,
)
from megarl.config.distillation_checks import teacher_dims
from megarl.config.lora_checks import lora_enabled
from megarl.config.model_dims import ModelDims, padded_vocab_size
from megarl.config.schema import MegarlConfig, MegatronConfig
from megarl.config.teachers import megatron_teacher_layout, teachers
from megarl.parallel.layout import ParallelLayout
from megarl.planner.activations import (
    Impl,
    Recompute,
    forward_activations,
    training_activations,
)
from megarl.planner.communicators import (
    NCCL_COMMUNICATOR_BYTES,
    nccl_communicators,
    rollout_rank_communicators,
)
from megarl.planner.memory import (
    GIB,
    ITEMSIZE,
    ModelState,
    OptimizerAssumptions,
    layer_experts_bytes,
    model_state,
    vllm_weight_bytes,
)
from megarl.planner.residency import (
    EngineResidency,
    Residency,
    engine_is_vllm,
    engine_on_training_ranks,
    residency,
    schedule,
)
from megarl.planner.vllm_pool import (
    TeacherPool,
    rollout_pool,
    teacher_pool,
)

BUCKET_BYTES = 1 << 30
"""The resharding executor's bucket limit (``DEFAULT_BUCKET_BYTES``)."""


@dataclass(frozen=True)
class Cluster:
    """The machines a config is planned for."""

    nodes: int
    gpus_per_node: int
    gpu_memory_gib: float = 79.2
    """Memory of one GPU as CUDA reports it (an H100 80GB: about 79.2 GiB)."""
    reserve_gib: float = 4.0
    """Kept free: CUDA context, fragmentation (NCCL's buffers are terms of their own)."""

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
    moe: bool = False
    """Whether the model has routed experts (the layout's EP and ETP then matter)."""
    rollout_gpus: int = 0
    """GPUs of vLLM's own, beyond the cluster's training GPUs (``rollout.nnodes`` > 0)."""
    teacher_gpus: int = 0
    """GPUs of the distillation teacher's vLLM pool (``distillation.nnodes`` > 0)."""
    teacher_kv_bytes: int = 1
    """What the teacher's pool leaves for vLLM's KV cache per GPU (<= 0: no room)."""

    @property
    def fits(self) -> bool:
        return (
            all(self.phase_fits(p) for p in self.phases)
            and self.kv_cache["bytes"] > 0
            and self.teacher_kv_bytes > 0
        )

    def phase_fits(self, phase: Phase) -> bool:
        return phase.total <= self.cluster.usable_bytes

    @property
    def peak(self) -> int:
        return max(p.total for p in self.phases)

    def reason(self) -> str:
        """Why it fits or not, in one line: the phases over the limit (else the peak phase)
        with each one's biggest term, and a KV cache with no room."""
        usable = self.cluster.usable_bytes / GIB
        bad = [p for p in self.phases if not self.phase_fits(p)]
        shown = bad or [max(self.phases, key=lambda p: p.total)]
        parts = []
        for phase in shown:
            big = max(phase.terms, key=lambda t: t.nbytes)
            parts.append(
                f"{phase.name} needs {phase.total / GIB:.1f} GiB of {usable:g} GiB usable, "
                f"biggest term: {big.name} {big.nbytes / GIB:.1f} GiB"
            )
        text = "; ".join(parts)
        if not bad:
            text = "peak " + text
        if self.kv_cache["bytes"] <= 0:
            text += "; rollout: no room left for vLLM's KV cache"
        if self.teacher_kv_bytes <= 0:
            text += "; teacher: no room left in its vLLM pool for the KV cache"
        return text

    def to_dict(self) -> dict[str, Any]:
        lay = self.layout
        return {
            "gpu_memory_bytes": self.cluster.gpu_bytes,
            "reserve_bytes": self.cluster.gpu_bytes - self.cluster.usable_bytes,
            "usable_bytes": self.cluster.usable_bytes,
            "layout": {"tp": lay.tp, "pp": lay.pp, "vpp": lay.vpp, "ep": lay.ep, "etp": lay.etp},
            "fits": self.fits,
            "reason": self.reason(),
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
            "rollout_gpus": self.rollout_gpus,
            "teacher_gpus": self.teacher_gpus,
            "teacher_kv_bytes": self.teacher_kv_bytes,
            "kv_cache": self.kv_cache,
            "assumptions": list(self.assumptions),
        }


@dataclass
class _Model:
    """One model's state per GPU (where each part is in a phase: the residency schedule)."""

    name: str
    state: ModelState


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


def _tokens(p: PassBatches, seq: int, cp: int = 1) -> tuple[int, int]:
    """(micro-batch sequences, sequence length) of a pass; a token budget is per GPU, a packed
    row of ``budget × CP`` tokens (verl's meaning)."""
    if p.micro_batch_size is not None:
        return p.micro_batch_size, seq
    budget = (p.max_token_len_per_gpu or seq) * cp
    return max(1, budget // seq), seq


def _per_cp(cfg) -> str:
    """How a term's label says its tokens are split over context parallelism."""
    cp = cfg.actor_rollout_ref.actor.megatron.context_parallel_size
    return f", /CP {cp}" if cp > 1 else ""


@functools.lru_cache(maxsize=64)
def _cached_state(dims, layout, world, role, opt) -> ModelState:
    return model_state(dims, layout, world, role, opt)


def _state(dims, layout, world, role, opt) -> ModelState:
    """:func:`model_state`, cached: the layout search plans each layout under four switches
    that leave it unchanged (a MoE layer has thousands of expert tensors)."""
    try:
        return _cached_state(dims, layout, world, role, opt)
    except TypeError:  # an unhashable rope_scaling value
        return model_state(dims, layout, world, role, opt)


def _models(
    cfg: MegarlConfig, dims: ModelDims, world: int, teacher: ModelDims | None = None
) -> list[_Model]:
    arr = cfg.actor_rollout_ref
    layout = arr.actor.megatron.parallel_layout()
    out = []
    roles = [("actor", arr.actor.megatron, arr.actor.optim.optimizer)]
    if critic_enabled(cfg):
        roles.append(("critic", cfg.critic.megatron, cfg.critic.optim.optimizer))
    lora = arr.model.lora.rank if lora_enabled(cfg) else 0
    for role, meg, optimizer in roles:
        opt = _assumptions(cfg, meg)
        rank = lora if role == "actor" else 0
        opt = OptimizerAssumptions(**{**opt.__dict__, "optimizer": optimizer, "lora_rank": rank})
        state = _state(dims, layout, world, role, opt)
        out.append(_Model(role, state))
    if ref_used(cfg) and not lora:  # LoRA: the reference is the actor with adapters off
        meg = arr.ref.megatron
        state = _state(dims, layout, world, "ref", _assumptions(cfg, meg))
        out.append(_Model("ref", state))
    if teacher is not None:  # frozen like the reference, its own shape at its own TP x PP
        own = megatron_teacher_layout(cfg) or layout
        state = _state(teacher, own, world, "ref", _assumptions(cfg, arr.ref.megatron))
        out.append(_Model("teacher", state))
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
    teacher = teacher_dims(cfg, dims) if teacher_used(cfg) else None
    models = {m.name: m for m in _models(cfg, dims, world, teacher)}
    pool, vllm, kv = rollout_pool(cfg, dims, cluster.gpu_bytes)
    transient = {
        "setup": _setup_terms(cfg, models),
        "old_log_prob": _forward_terms(cfg, dims, "actor", batches.old_log_prob, seq),
        "ref": _forward_terms(cfg, dims, "ref", batches.ref_log_prob, seq),
        "teacher": (
            _forward_terms(cfg, teacher, "ref", batches.ref_log_prob, seq) if teacher else ()
        ),
        "values": _forward_terms(cfg, dims, "critic", batches.values, seq),
        "update_critic": _update_terms(cfg, dims, "critic", batches.critic, seq),
        "update_actor": _update_terms(cfg, dims, "actor", batches.actor, seq),
        "sync": _sync_terms(cfg, dims),
    }
    own = rollout_ranks(cfg)
    nccl = bool(own) and engine_is_vllm(cfg) and not stages_weight_updates(cfg)  # GPU to GPU
    bucket = _bucket_bytes(cfg, dims)
    if nccl:
        transient["sync"] += (Term("bucket sent to the rollout ranks", bucket,
                                   "the first training rank's copy for NCCL: one bucket"),)  # fmt: skip
    phases, most_offloaded = [], 0
    graphs = kv["cuda_graph_bytes"]
    training_comms = nccl_communicators(cfg, world)
    if nccl:  # the first training rank's end of the weights' group
        training_comms["weights"] = own + 1
    comms = (_nccl_term(training_comms),)
    for name, placed in schedule(cfg).items():
        resident = _resident_terms(placed, models)
        engine = _engine_terms(placed, pool, vllm, graphs)
        phases.append(Phase(name, (*resident, *engine, *comms, *transient.get(name, ()))))
        most_offloaded = max(most_offloaded, _in_host_memory(placed, models))
    if own and engine_is_vllm(cfg):  # vLLM on GPUs of its own: its pool, and a bucket coming in
        received = (
            (Term("bucket received", bucket, "one bucket at a time, over NCCL"),) if nccl else ()
        )
        own_comms = _nccl_term(rollout_rank_communicators(cfg, nccl))
        engine = _engine_terms(OWN_GPUS, pool, vllm, graphs)
        phases.append(Phase("rollout ranks", (*engine, own_comms, *received)))
    teacher_gpus, teacher_kv = teacher_ranks(cfg), 1
    if teacher_gpus:  # the distillation teachers' vLLM on a pool of their own
        found = teachers(cfg)
        pools = [teacher_pool(cfg, teacher_dims(cfg, dims, spec.model_path), cluster.gpu_bytes,
                              spec) for spec in found]  # fmt: skip
        for spec, teacher in zip(found, pools, strict=True):
            phases.append(_teacher_phase(teacher, spec.name if len(found) > 1 else None))
        teacher_kv = min(teacher.kv for teacher in pools)
    level1 = bool(cfg.trainer.skip_weight_sync_steps) and arr.rollout.free_cache_engine
    part = vllm_weight_bytes(
        dims, arr.rollout.tensor_model_parallel_size, ITEMSIZE[cfg.trainer.dtype]
    )
    host = (
        Term(
            "offloaded training state",
            most_offloaded * cluster.gpus_per_node,
            "G_node × the most any phase keeps in host memory (params, main params, Adam; "
            "offloaded gradient buffers are dropped, not copied)",
        ),
        Term(
            "vLLM weights asleep (level 1)",
            (vllm if level1 and engine_on_training_ranks(cfg) else 0) * cluster.gpus_per_node,
            "G_node × vLLM weights per rank (level 1 only before a skipped sync; else level 2)",
        ),
        Term(
            "weight updates staged on rollout ranks",
            part * _rollout_ranks_per_node(cfg) if stages_weight_updates(cfg) else 0,
            "rollout ranks per node × vLLM's weights per rank (each receives what its vLLM TP "
            "rank loads while it generates, beyond one step off; on nodes of their own: those "
            "nodes' RAM)",
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
        f"gradient buffers in fp32 (grad_reduce_in_fp32), {'distributed' if arr.actor.megatron.use_distributed_optimizer else 'plain'} optimizer over DP {layout.data_parallel_size(world)}"
        + (f" × CP {layout.cp} (Megatron shards over both)" if layout.cp > 1 else ""),
        (
            "residency by phase: megarl/planner/residency.py (what the trainer applies); the reward "
            "model and the checkpoint save's optimizer gather are not modelled"
        ),
        f"reserve {cluster.reserve_gib:g} GiB per GPU for the CUDA context and fragmentation",
        (
            f"NCCL: {NCCL_COMMUNICATOR_BYTES / GIB:g} GiB per communicator of >= 2 ranks (an "
            "estimate; NVLS adds more); vLLM asleep keeps its CUDA graphs "
            f"({graphs / GIB:g} GiB estimated)"
        ),
    )
    if dims.is_moe:
        per_rank = dims.num_experts // layout.ep
        edp = layout.expert_data_parallel_size(world)
        notes += (
            (
                f"MoE: {dims.num_experts} experts over EP {layout.ep} ({per_rank} per rank), "
                f"expert TP {layout.etp}, expert DP {edp}; top-{dims.moe_router_topk} routing "
                "balanced, no token dropping; vLLM keeps every expert, split over its TP"
            ),
        )
    return MemoryPlan(cluster, layout, tuple(phases), host, kv, notes, dims.is_moe, own,
                      teacher_gpus, teacher_kv)  # fmt: skip


def _teacher_phase(teacher: TeacherPool, name: str | None = None) -> Phase:
    """A teacher rank's device (phase ``teacher ranks``, ``teacher ranks (<name>)`` of one of
    several teachers): its weights and the rest of its pool."""
    return Phase("teacher ranks" + (f" ({name})" if name else ""), (
        Term("teacher's vLLM weights", teacher.weights,
             f"the teacher's weights per rank (TP {teacher.tp})"),
        Term(
            "teacher's vLLM activations and KV",
            max(teacher.pool - teacher.weights, teacher.profile),
            "the rest of inference.gpu_memory_utilization × G (a prefill of "
            f"max_num_batched_tokens {teacher.tokens}, its logits for the prompt log-probs, "
            "the KV cache)",
        ),
    ))  # fmt: skip


_PARTS = (("params", "params", "e·n_pad (e·n without distributed optimizer)"),
          ("grads", "gradient buffers", "4·n_pad (grad_reduce_in_fp32)"),
          ("optimizer", "fp32 main params + Adam moments", "4·n/N + 8·n/N (16-bit params)"))  # fmt: skip
_EXPERT_FORMULAS = {"params": "e·n_e,pad: E/EP experts split over expert TP",
                    "grads": "4·n_e,pad (grad_reduce_in_fp32)",
                    "optimizer": "4·n_e/N_e + 8·n_e/N_e over expert DP N_e"}  # fmt: skip


def _parts(state: ModelState) -> dict[str, int]:
    return {"params": state.params, "grads": state.grads,
            "optimizer": state.main_params + state.optimizer_states}  # fmt: skip


def _resident_terms(placed: Residency, models: dict[str, _Model]) -> list[Term]:
    """The state ``placed`` keeps on the device, one term per model and part (MoE: the dense
    part and the experts apart)."""
    terms = []
    for role, on in placed.models.items():
        state = models[role].state
        sizes = _parts(state)
        experts = _parts(state.experts) if state.experts else None
        for part, label, formula in _PARTS:
            if not getattr(on, part):
                continue
            dense = sizes[part] - (experts[part] if experts else 0)
            if dense:
                suffix = ", non-expert" if experts else ""
                terms.append(Term(f"{role} {label}{suffix}", dense, formula))
            if experts and experts[part]:
                terms.append(Term(f"{role} expert {label}", experts[part], _EXPERT_FORMULAS[part]))
    return terms


def _in_host_memory(placed: Residency, models: dict[str, _Model]) -> int:
    """Bytes ``placed`` keeps in host memory: offloaded parameters (a host copy) and optimizer
    state (moved); offloaded gradient buffers are dropped (they are zero between updates)."""
    total = 0
    for role, on in placed.models.items():
        s = models[role].state
        total += (0 if on.params else s.params) + (
            0 if on.optimizer else s.main_params + s.optimizer_states
        )
    return total


def _engine_terms(placed: Residency, pool: int, weights: int, graphs: int) -> list[Term]:
    """vLLM on this GPU: its pool awake (CUDA graphs included: vLLM sizes the KV cache after
    them), else its weights and its CUDA graphs, which no sleep level frees."""
    engine = placed.engine
    if engine is None:
        return []
    if engine.kv_cache:
        return [Term("vLLM pool", pool, "gpu_memory_utilization × G (weights, activations, KV)")]
    kept = Term("vLLM CUDA graphs", graphs, "kept while asleep (0 with enforce_eager)")
    if engine.weights:
        return [Term("vLLM weights (awake)", weights, "vLLM weights per rank"), kept]
    return [Term("vLLM asleep", 0, "level 2 (or 1 before a skipped sync): weights, KV freed"), kept]


def _nccl_term(comms: dict[str, int]) -> Term:
    groups = ", ".join(f"{name} {size}" for name, size in comms.items()) or "none"
    return Term(
        "NCCL communicators",
        len(comms) * NCCL_COMMUNICATOR_BYTES,
        f"{len(comms)} × {NCCL_COMMUNICATOR_BYTES / GIB:g} GiB (groups and pairs of >= 2 ranks: "
        f"{groups})",
    )


OWN_GPUS = Residency({}, EngineResidency(weights=True, kv_cache=True))
"""A rollout rank's device: vLLM awake, nothing else."""


def _rollout_ranks_per_node(cfg) -> int:
    roll = cfg.actor_rollout_ref.rollout
    return min(rollout_ranks(cfg), roll.n_gpus_per_node or cfg.trainer.n_gpus_per_node)


def _setup_terms(cfg, models: dict[str, _Model]) -> tuple[Term, ...]:
    """The largest model while it is built: all its parameters, gradient buffers and main
    parameters (Adam's moments come at its first step) beyond what its setup residency keeps."""
    setup = residency(cfg, "setup").models
    best = (0, "")
    for role, m in models.items():
        s, on = m.state, setup[role]
        extra = (0 if on.params else s.params) + (0 if on.grads else s.grads)
        extra += 0 if on.optimizer else s.main_params
        best = max(best, (extra, role))
    if not best[1]:
        return ()
    return (Term(f"{best[1]} while built", best[0], "params + grads + main params not kept"),)


def _forward_terms(cfg, dims, role: str, p: PassBatches | None, seq: int) -> tuple[Term, ...]:
    """A forward-only pass's activations (one layer, the logits, the log-prob working set)."""
    if p is None:
        return ()
    b, s = _tokens(p, seq, cfg.actor_rollout_ref.actor.megatron.context_parallel_size)
    act = forward_activations(
        dims, cfg.actor_rollout_ref.actor.megatron.parallel_layout(), micro_batch=b, seq_len=s,
        dtype=cfg.trainer.dtype, impl=_impl(cfg, cfg.actor_rollout_ref.actor.megatron),
        role="critic" if role == "critic" else "actor",
    )  # fmt: skip
    return (
        Term(f"forward activations, {p.name} (b={b}, s={s}{_per_cp(cfg)})", act.peak,
             "one layer + logits + log-prob working set"),
    )  # fmt: skip


def _update_terms(cfg, dims, role: str, p: PassBatches | None, seq: int) -> tuple[Term, ...]:
    """A model's training activations (its state is in the phase's residency terms)."""
    if p is None:
        return ()
    arr = cfg.actor_rollout_ref
    meg = cfg.critic.megatron if role == "critic" else arr.actor.megatron
    b, s = _tokens(p, seq, arr.actor.megatron.context_parallel_size)
    act = training_activations(
        dims, arr.actor.megatron.parallel_layout(), micro_batch=b, seq_len=s,
        micro_batches=p.micro_batches_per_rank or 1, dtype=cfg.trainer.dtype,
        impl=_impl(cfg, meg), role=role,
        recompute=Recompute(meg.recompute_granularity, meg.recompute_method,
                            meg.recompute_num_layers),
    )  # fmt: skip
    return (
        Term(f"{role} saved activations (b={b}, s={s}{_per_cp(cfg)})", act.saved,
             "in-flight micro-batches × layers × bytes/token"),
        Term(f"{role} recompute + log-prob working set", act.working,
             "one recomputed group; e·b·s·V/t + 20·b·1024·V/t"),
    )  # fmt: skip


def _sync_terms(cfg, dims) -> tuple[Term, ...]:
    layout = cfg.actor_rollout_ref.actor.megatron.parallel_layout()
    e = ITEMSIZE[cfg.trainer.dtype]
    gather = (
        padded_vocab_size(dims.vocab_size, layout.tp) * dims.hidden_size * e if layout.tp > 1 else 0
    )
    formula = "max(1 GiB, E·3·F_e·h·e: one layer's experts)" if dims.is_moe else "1 GiB"
    return (
        Term("sync bucket + TP all-gather", _bucket_bytes(cfg, dims) + gather,
             formula + " + V·h·e (TP > 1)"),
    )  # fmt: skip


def _bucket_bytes(cfg, dims) -> int:
    """The largest bucket of a weight sync: 1 GiB, or one layer's experts when larger."""
    return max(BUCKET_BYTES, layer_experts_bytes(dims, ITEMSIZE[cfg.trainer.dtype]))
