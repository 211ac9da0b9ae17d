"""The layout search of ``megarl plan``: when a config does not fit, the cheapest layouts and
switches that do (:func:`search_layouts`), each planned by :func:`~megarl.planner.memory_plan.
plan_memory` and returned as the overrides that select it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from megarl.config.batch_plan import BatchPlan
from megarl.config.layout_checks import divisors
from megarl.config.model_dims import ModelDims
from megarl.config.schema import MegarlConfig, MegatronConfig
from megarl.parallel.layout import ParallelLayout
from megarl.planner.memory_plan import Cluster, MemoryPlan, plan_memory


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
    ep: int = 1
    """Expert parallelism (MoE models)."""
    etp: int = 1
    """Expert tensor parallelism (MoE models)."""

    @property
    def key(self) -> tuple:
        """Sort key: no offload first, TP and the expert grid (ETP × EP, its all-to-all) inside
        a node, less bubble, no recompute, lower peak."""
        gpus = self.plan.cluster.gpus_per_node
        cross_node = self.tp > gpus or self.etp * self.ep > gpus
        return (self.offload, cross_node, round(self.bubble, 6), self.recompute, self.plan.peak)


def _with(
    cfg: MegarlConfig,
    tp: int,
    pp: int,
    offload: bool,
    recompute: bool,
    expert: tuple[int, int] | None = None,
) -> tuple:
    """A copy of ``cfg`` with this layout and these switches on every model, and the overrides
    (only keys whose value changes) that select it. ``expert``: (EP, ETP) of a MoE model,
    which also turns sequence parallelism on at TP > 1 (Megatron requires it with EP > 1)."""
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
    if expert is not None:
        ep, etp = expert
        values["expert_model_parallel_size"] = ep
        values["expert_tensor_parallel_size"] = None if etp == tp else etp
        if tp > 1:
            values["sequence_parallel"] = True
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


def _layouts(dims: ModelDims, world: int) -> list[ParallelLayout]:
    """Legal layouts of the search: TP × PP dividing the world (no VPP, CP 1) and, for a MoE
    model, EP dividing the experts with ETP 1 or TP (``ETP × EP × PP`` dividing the world)."""
    from megarl.parallel.layout import shape_layout_problems

    out = []
    shape = dims.known()
    for tp in divisors(world):
        for pp in divisors(world // tp):
            experts = [(1, None)]
            if dims.is_moe:
                experts = [
                    (ep, etp if etp != tp else None)
                    for ep in divisors(dims.num_experts)
                    for etp in sorted({1, tp})
                    if world % (etp * ep * pp) == 0
                ]
            for ep, etp in experts:
                layout = ParallelLayout(tp, pp, expert_model_parallel_size=ep,
                                        expert_tensor_parallel_size=etp)  # fmt: skip
                if not shape_layout_problems(layout, shape):
                    out.append(layout)
    return out


def search_layouts(
    cfg: MegarlConfig, dims: ModelDims, cluster: Cluster, *, limit: int = 5
) -> list[Proposal]:
    """The ``limit`` best layouts (TP × PP, and EP × ETP for MoE models; distributed optimizer,
    no VPP) and switches (all offloads on/off, full recompute on/off) that fit, sorted by
    :attr:`Proposal.key`.

    A layout is legal by the one rule (:func:`megarl.parallel.layout.layout_problems`) and when
    the batch sizes divide over its DP size; rollout settings are kept as configured.
    """
    from megarl.config.errors import ConfigError

    world = cluster.world
    found: list[Proposal] = []
    for layout in _layouts(dims, world):
        tp, pp = layout.tp, layout.pp
        expert = (layout.ep, layout.etp) if dims.is_moe else None
        for offload in (False, True):
            for recompute in (False, True):
                candidate, overrides = _with(cfg, tp, pp, offload, recompute, expert)
                try:
                    plan = plan_memory(candidate, dims, cluster)
                    m = BatchPlan.from_config(candidate, world).actor.micro_batches_per_rank
                except ConfigError:
                    continue
                if plan.fits:
                    bubble = (pp - 1) / ((m or 1) + pp - 1)
                    found.append(
                        Proposal(tp, pp, offload, recompute, bubble, plan, overrides,
                                 layout.ep, layout.etp)
                    )  # fmt: skip
    return sorted(found, key=lambda p: p.key)[:limit]
