"""The resharding executor's Megatron entry points: the plan for an actor's model chunks, their
parameters checked against it, and the sync itself (:func:`sync_weights`), which runs
:func:`~megarl.rollout.reshard.executor.stream_buckets` with Megatron's process groups."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import torch
from torch import Tensor

from megarl.config.model_dims import ModelDims
from megarl.parallel.layout import PIPELINE_SPLIT_FIELDS, ParallelLayout
from megarl.rollout.base import WeightSink
from megarl.rollout.reshard.executor import SyncStats, stream_buckets
from megarl.rollout.reshard.make_plan import make_reshard_plan
from megarl.rollout.reshard.plan import DEFAULT_BUCKET_BYTES, ReshardPlan

__all__ = ["local_params_for_plan", "plan_for_chunks", "sync_weights"]


def plan_for_chunks(
    chunks: Sequence[torch.nn.Module],
    dims: ModelDims,
    rollout_tp: int,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    rollout_ep: bool = False,
) -> ReshardPlan:
    """The plan for this actor: layout (layer split included) from its ``TransformerConfig``,
    dtype from its weights.
    ``rollout_ep``: the engine runs vLLM expert parallelism (see :func:`make_reshard_plan`)."""
    from megarl.models.gpt import unwrap

    model = unwrap(chunks[0])
    cfg = model.config
    vpp = cfg.virtual_pipeline_model_parallel_size
    layout = ParallelLayout(
        cfg.tensor_model_parallel_size,
        cfg.pipeline_model_parallel_size,
        vpp if vpp else None,
        expert_model_parallel_size=cfg.expert_model_parallel_size,
        expert_tensor_parallel_size=cfg.expert_tensor_parallel_size,
        **{key: getattr(cfg, key) for key in PIPELINE_SPLIT_FIELDS},
    )
    dtype = next(model.parameters()).dtype
    return make_reshard_plan(
        dims, layout, rollout_tp, bucket_bytes=bucket_bytes, dtype=dtype, rollout_ep=rollout_ep
    )


def local_params_for_plan(
    chunks: Sequence[torch.nn.Module], plan: ReshardPlan
) -> tuple[dict[str, Tensor], int, int]:
    """This rank's parameters by global name (experts by global index), checked against the
    plan's ownership, with its pipeline stage and expert-parallel rank.

    Raises ``ValueError`` when Megatron put a parameter on another stage / chunk / EP rank than
    the plan (different layer or expert split), or a planned parameter of this rank is missing.
    """
    from megatron.core import parallel_state

    from megarl.models.weights import local_global_names

    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    ep_rank = parallel_state.get_expert_model_parallel_rank() if plan.layout.ep > 1 else 0
    params: dict[str, Tensor] = {}
    for chunk_index, _local, name, param in local_global_names(chunks):
        transfer = plan.params.get(name)
        if transfer is None:
            if name in plan.skipped:
                continue
            raise ValueError(
                f"{name} (stage {pp_rank}, chunk {chunk_index}) is not in the plan: a critic's "
                "value head, or a plan made for another model?"
            )
        if (transfer.pp_rank, transfer.vp_stage) != (pp_rank, chunk_index):
            raise ValueError(
                f"{name}: Megatron holds it on stage {pp_rank} chunk {chunk_index}, the plan on "
                f"stage {transfer.pp_rank} chunk {transfer.vp_stage}"
            )
        if transfer.ep_rank not in (None, ep_rank):
            raise ValueError(
                f"{name}: Megatron holds it on expert-parallel rank {ep_rank}, the plan on "
                f"{transfer.ep_rank}"
            )
        params[name] = param
    missing = [
        n
        for n, t in plan.params.items()
        if t.pp_rank == pp_rank and t.ep_rank in (None, ep_rank) and n not in params
    ]
    if missing:
        raise ValueError(f"stage {pp_rank} lacks planned parameters {missing[:4]}")
    return params, pp_rank, ep_rank


def sync_weights(
    chunks: Sequence[torch.nn.Module],
    plan: ReshardPlan,
    sink: WeightSink,
    *,
    fill_unsent: float | None = None,
) -> SyncStats:
    """Push the actor's weights into the rollout engine (collective: every rank calls it).

    ``chunks`` are this rank's model chunks (plain or DDP-wrapped); ``plan`` must match the
    current Megatron layout (see :func:`plan_for_chunks`) and the engine's TP size. Afterwards
    the engine holds exactly the actor's weights and has dropped its prefix cache.
    ``fill_unsent``: see :func:`stream_buckets`.
    """
    from megatron.core import parallel_state

    lay = plan.layout
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    ep = parallel_state.get_expert_model_parallel_world_size()
    etp = parallel_state.get_expert_tensor_parallel_world_size()
    if (tp, pp) != (lay.tp, lay.pp) or (plan.dims.num_experts and (ep, etp) != (lay.ep, lay.etp)):
        raise ValueError(
            f"plan is for TP={lay.tp}, PP={lay.pp}, EP={lay.ep}, ETP={lay.etp}; running TP={tp}, "
            f"PP={pp}, EP={ep}, ETP={etp}"
        )
    from megarl.models.lora import any_rank_has_adapters, merged_weights

    adapter_only = getattr(sink, "lora_adapter_sync", False) and any_rank_has_adapters(chunks)
    if adapter_only and sink.base_loaded:  # lora.merge=false: the base is there, send adapters
        return sync_adapters(chunks, plan, sink)
    params, pp_rank, ep_rank = local_params_for_plan(chunks, plan)
    if not adapter_only:  # LoRA with lora.merge=true: W + scaling·B·A shards
        params.update(merged_weights(chunks))
    experts = plan.dims.num_experts > 0
    stats = stream_buckets(
        params,
        plan,
        sink,
        pp_rank=pp_rank,
        tp_group=parallel_state.get_tensor_model_parallel_group() if tp > 1 else None,
        pp_group=parallel_state.get_pipeline_model_parallel_group() if pp > 1 else None,
        ep_rank=ep_rank,
        ep_group=parallel_state.get_expert_model_parallel_group() if ep > 1 else None,
        etp_group=(
            parallel_state.get_expert_tensor_parallel_group() if experts and etp > 1 else None
        ),
        fill_unsent=fill_unsent,
    )
    if adapter_only:  # the first sync (or after sleep level 2): the base, then the adapters
        more = sync_adapters(chunks, plan, sink)
        stats = dataclasses.replace(
            stats, bytes=stats.bytes + more.bytes, seconds=stats.seconds + more.seconds
        )
    return stats


def sync_adapters(chunks: Sequence[torch.nn.Module], plan: ReshardPlan, sink) -> SyncStats:
    """``lora.merge=false`` after the base went once: every rank hands the engine the whole
    model's adapters in PEFT form (:meth:`~megarl.rollout.vllm_engine.VLLMEngine.load_adapter`,
    or :meth:`~megarl.rollout.remote.engine.RemoteEngine.load_adapter` for vLLM on ranks of its
    own; collective). ``bytes``: the adapter tensors handed over (a full sync's counts the
    model)."""
    from megarl.models.lora_peft import every_stage_adapters

    start = time.perf_counter()
    state, config = every_stage_adapters(chunks, plan.dims)
    sent = sink.load_adapter(state, config)
    return SyncStats(buckets=0, bytes=sent, gathered_bytes=0, seconds=time.perf_counter() - start)
