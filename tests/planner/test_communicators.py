"""The planner's NCCL communicators are the ones ``connect_groups`` makes at set-up.

In process, without peers: each rank of a layout starts torch's fake backend (every collective
and send returns at once), builds Megatron's parallel state at the sizes ``init_distributed``
passes (without Megatron's gloo groups, which need real peers and are no NCCL communicators) and
runs :func:`megarl.parallel.connect.connect_groups` with the vLLM TP size ``build_run`` gives it.
Rank 0's communicators of two or more ranks, by name and size, must be what
:func:`megarl.planner.communicators.nccl_communicators` counts, and no rank may hold more.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.config import load_config
from megarl.parallel.layout import ParallelLayout
from megarl.planner.communicators import nccl_communicators

CFG_7B = str(Path(__file__).resolve().parents[2] / "configs" / "grpo_qwen2_5_7b.yaml")
MEG = "actor_rollout_ref.actor.megatron"
ROLL = "actor_rollout_ref.rollout"
VLLM = ("vLLM TP", "vLLM TP (PyNccl)")  # vLLM's own groups, not connect_groups'

# world, (TP, PP, VPP, CP, EP, ETP), a colocated vLLM's TP (None: the actor engine)
LAYOUTS = {
    "tp4_vllm2": (8, (4, 1, None, 1, 1, None), 2),  # the 7B config
    "tp2_pp2_ep2_vllm8": (8, (2, 2, None, 1, 2, None), 8),  # the executor's pipeline pair
    "pp2_vpp2": (4, (1, 2, 2, 1, 1, None), None),  # the interleaved ring, one way over the world
    "tp2_pp4_vpp2": (8, (2, 4, 2, 1, 1, None), None),  # a ring of four stages
    "pp3_vllm4": (6, (2, 3, None, 1, 1, None), 4),  # a middle stage outside the embedding group
    "tp2_cp4": (8, (2, 1, None, 4, 1, None), None),  # TE's context-parallel ring
    "moe_cp2_pp4_vpp2_ep2_etp1_vllm8": (16, (2, 4, 2, 2, 2, 1), 8),  # all of them at once
}


def _layout(sizes) -> ParallelLayout:
    tp, pp, vpp, cp, ep, etp = sizes
    return ParallelLayout(tp, pp, vpp, cp, ep, expert_tensor_parallel_size=etp)


def _config(sizes, rollout_tp, extra=()):
    tp, pp, vpp, cp, ep, etp = sizes
    engine = [f"{ROLL}.name=actor"] if rollout_tp is None else [
        f"{ROLL}.tensor_model_parallel_size={rollout_tp}"]  # fmt: skip
    return load_config(CFG_7B, [
        f"{MEG}.tensor_model_parallel_size={tp}", f"{MEG}.pipeline_model_parallel_size={pp}",
        f"{MEG}.virtual_pipeline_model_parallel_size={'null' if vpp is None else vpp}",
        f"{MEG}.context_parallel_size={cp}", f"{MEG}.expert_model_parallel_size={ep}",
        f"{MEG}.expert_tensor_parallel_size={'null' if etp is None else etp}", *engine, *extra,
    ])  # fmt: skip


def _connected_on_fake_ranks(world: int, layout: ParallelLayout, rollout_tp, prefix=""):
    """Per rank, ``{name: size}`` of the communicators of two or more ranks ``connect_groups``
    made (a pair as ``"pipeline 0<->4"``); ``prefix``: a second layout's, the world left out
    (the one world group both layouts share)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    from megarl.parallel.connect import connect_groups

    assert not dist.is_initialized(), "a process group left over from another test"
    ranks = []
    for rank in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=layout.tp,
                pipeline_model_parallel_size=layout.pp,
                virtual_pipeline_model_parallel_size=layout.virtual_pipeline_model_parallel_size,
                context_parallel_size=layout.cp,
                expert_model_parallel_size=layout.ep,
                expert_tensor_parallel_size=layout.etp,
                create_gloo_process_groups=False,
            )
            made = {}
            for c in connect_groups(rollout_tp):
                if prefix and c.group is dist.group.WORLD:
                    continue
                name = prefix + (f"{c.name} {c.pair[0]}<->{c.pair[1]}" if c.pair else c.name)
                made[name] = 2 if c.pair else dist.get_world_size(c.group)
            ranks.append({name: size for name, size in made.items() if size > 1})
        finally:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
    return ranks


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_the_planner_counts_what_connect_groups_makes(case):
    world, sizes, rollout_tp = LAYOUTS[case]
    planned = nccl_communicators(_config(sizes, rollout_tp), world)
    made = _connected_on_fake_ranks(world, _layout(sizes), rollout_tp)
    assert {n: s for n, s in planned.items() if n not in VLLM} == made[0]
    assert (rollout_tp is not None) == all(name in planned for name in VLLM)
    assert max(len(rank) for rank in made) == len(made[0]), [sorted(r) for r in made]


def test_a_megatron_teacher_at_its_own_layout_adds_its_groups_but_not_the_world():
    """``second_layout`` runs ``connect_groups()`` on the teacher's own parallel state (TP × PP,
    its expert grid Megatron's default); the world group is the one object both use."""
    t = "distillation.teacher_models.teacher_model"
    teacher = ["distillation.enabled=true", "distillation.nnodes=0",
               f"{t}.model_path=Qwen/Qwen3-32B", f"{t}.inference.name=megatron",
               f"{t}.inference.tensor_model_parallel_size=2",
               f"+{t}.inference.pipeline_model_parallel_size=2"]  # fmt: skip
    sizes = (4, 1, None, 1, 1, None)
    planned = nccl_communicators(_config(sizes, 2, teacher), 8)
    actor = _connected_on_fake_ranks(8, _layout(sizes), 2)[0]
    own = _connected_on_fake_ranks(8, ParallelLayout(2, 2), None, prefix="teacher ")[0]
    assert {n: s for n, s in planned.items() if n not in VLLM} == {**actor, **own}
    assert "teacher embedding" in own and "teacher world" not in planned
