"""Every communicator a trainer step uses was created at set-up (``connect_groups``).

On a GPU a communicator NCCL first makes after generation has filled the cache fails ("Failed
to CUDA calloc async", an H100, 2026-11-27). On CPU the same calls run on gloo: one launch of 2
real ranks runs the trainer's set-up and one step per case, logging every collective and single
send or receive, and each must be one ``connect_groups`` made. The cases reach the groups the
first version missed: the router losses' tensor × context group and the allgather dispatcher's
expert-tensor × expert group (MoE at CP 2 × EP 2), DDP's data × context group, the pipeline
pair the reshard executor sends over (PP 2, vLLM TP 2's rule) and the interleaved schedule's
single sends (PP 2 × VPP 2).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megarl.parallel.connect import point_to_point_pairs
from tests.conftest import run_torchrun

WORKER = Path(__file__).with_name("_groups_worker.py")
MEG = "actor_rollout_ref.actor.megatron"
OVERRIDES = [
    "actor_rollout_ref.rollout.name=actor",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    f"{MEG}.tensor_model_parallel_size=1",
    "data.train_batch_size=2",
    "data.max_response_length=4",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
    "trainer.save_freq=-1",
]


def test_pairs_are_the_ring_and_the_executors_rule():
    assert point_to_point_pairs([0, 2, 4, 6], ring=True) == [(0, 2), (0, 6), (2, 4), (4, 6)]
    assert point_to_point_pairs([0, 1], ring=True) == [(0, 1)]
    # vLLM TP 2: stages on ranks 0 and 4 are both vLLM rank 0 (a broadcast, no pair); 1 and 4 not
    assert point_to_point_pairs([0, 4], ring=False, rollout_tp=2) == []
    assert point_to_point_pairs([1, 4, 7], ring=False, rollout_tp=2) == [(1, 4), (1, 7), (4, 7)]
    assert point_to_point_pairs([3], ring=True, rollout_tp=2) == []


@pytest.fixture(scope="module")
def steps(tiny_overrides, tmp_path_factory) -> dict:
    from megarl.models.tiny import make_tiny_model

    tmp = tmp_path_factory.mktemp("groups")
    moe = make_tiny_model(tmp / "tiny-moe", family="qwen3_moe", num_layers=2)
    cases = [
        {"name": "pp2_sync_tp2", "config": "configs/grpo_tiny_cpu.yaml", "sync_rollout_tp": 2,
         "overrides": [f"{MEG}.pipeline_model_parallel_size=2",
                       "actor_rollout_ref.rollout.tensor_model_parallel_size=2"]},
        {"name": "pp2_vpp2", "config": "configs/grpo_tiny_cpu.yaml",
         "overrides": [f"{MEG}.pipeline_model_parallel_size=2",
                       f"{MEG}.virtual_pipeline_model_parallel_size=2"]},
        {"name": "moe_cp2_ep2", "config": "configs/grpo_moe_tiny_cpu.yaml",
         "overrides": [f"actor_rollout_ref.model.path={moe}",
                       f"{MEG}.context_parallel_size=2", f"{MEG}.expert_model_parallel_size=2",
                       f"+{MEG}.override_transformer_config.moe_token_dispatcher_type=allgather"]},
    ]  # fmt: skip
    spec = {"overrides": [*tiny_overrides, *OVERRIDES], "cases": cases, "tmp": str(tmp),
            "out": str(tmp / "groups.json")}  # fmt: skip
    (tmp / "spec.json").write_text(json.dumps(spec))
    run_torchrun(WORKER, 2, [str(tmp / "spec.json")], timeout=900)
    return json.loads((tmp / "groups.json").read_text())


@pytest.mark.multirank
@pytest.mark.parametrize("case", ["pp2_sync_tp2", "pp2_vpp2", "moe_cp2_ep2"])
def test_a_step_uses_only_communicators_made_at_set_up(steps, case):
    for rank, got in enumerate(steps[case]):
        assert got["unconnected"] == [], (case, rank, got["unconnected"], got["connected"])
        assert got["max_connections"] == "1"  # init_distributed sets it before CUDA starts
    used = set(steps[case][0]["used"])
    expected = {  # what each case is there for
        "pp2_sync_tp2": {"pipeline 0<->1"},  # the reshard executor's single sends
        "pp2_vpp2": {"pipeline 0<->1", "world 0<->1"},  # the interleaved schedule's
        "moe_cp2_ep2": {"tensor×context", "expert tensor×expert", "data×context"},
    }[case]
    assert expected <= used, (case, sorted(used))
