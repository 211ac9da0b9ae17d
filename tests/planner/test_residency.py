"""The residency schedule by hand: which state is on the device in each phase, and vLLM's sleep
level (the trainer applying it: tests/trainer/test_trainer_runs.py; the planner summing it:
tests/planner/test_memory_plan.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.config import load_config
from megarl.planner.residency import (
    EngineResidency,
    ModelResidency,
    phases_of,
    residency,
    sleep_level,
)

CFG_72B = str(Path(__file__).resolve().parents[2] / "configs" / "ppo_qwen2_5_72b.yaml")
ON, OFF = ModelResidency(True, True, True), ModelResidency(False, False, False)


def test_every_offload_on_each_model_is_on_the_device_only_when_it_computes():
    cfg = load_config(CFG_72B)  # every offload on, for actor, critic and reference
    params_only, ref_on = ModelResidency(True, False, False), ModelResidency(True, False, False)
    expected = {
        "setup": ({"actor": OFF, "critic": OFF, "ref": OFF}, EngineResidency(False, False)),
        "generate": ({"actor": OFF, "critic": OFF, "ref": OFF}, EngineResidency(True, True)),
        "reward": ({"actor": OFF, "critic": OFF, "ref": OFF}, EngineResidency(False, False)),
        "old_log_prob": ({"actor": params_only, "critic": OFF, "ref": OFF},
                         EngineResidency(False, False)),
        "ref": ({"actor": OFF, "critic": OFF, "ref": ref_on}, EngineResidency(False, False)),
        "values": ({"actor": OFF, "critic": params_only, "ref": OFF},
                   EngineResidency(False, False)),
        "update_critic": ({"actor": OFF, "critic": ON, "ref": OFF}, EngineResidency(False, False)),
        "update_actor": ({"actor": ON, "critic": OFF, "ref": OFF}, EngineResidency(False, False)),
        "sync": ({"actor": params_only, "critic": OFF, "ref": OFF}, EngineResidency(True, False)),
        "checkpoint": ({"actor": ModelResidency(True, False, True),
                        "critic": ModelResidency(True, False, True), "ref": OFF},
                       EngineResidency(True, False)),
    }  # fmt: skip
    assert phases_of(cfg) == tuple(expected)
    for phase, (models, engine) in expected.items():
        got = residency(cfg, phase)
        assert (got.models, got.engine) == (models, engine), phase


def test_without_offloads_everything_stays_and_the_actor_engine_has_no_engine_state():
    meg = "actor_rollout_ref.actor.megatron"
    no_offload = [f"{m}.{k}_offload=false" for m in (meg, "critic.megatron")
                  for k in ("param", "grad", "optimizer")]  # fmt: skip
    no_offload.append("actor_rollout_ref.ref.megatron.param_offload=false")
    cfg = load_config(CFG_72B, [*no_offload, "actor_rollout_ref.rollout.name=actor"])
    for phase in phases_of(cfg):
        got = residency(cfg, phase)
        assert got.engine is None
        assert got.models == {"actor": ON, "critic": ON, "ref": ModelResidency(True, False, False)}


def test_vllm_stays_awake_without_free_cache_engine():
    cfg = load_config(CFG_72B, ["actor_rollout_ref.rollout.free_cache_engine=false"])
    assert {residency(cfg, p).engine for p in phases_of(cfg)} == {EngineResidency(True, True)}


def test_no_critic_and_no_reference_means_no_such_phases():
    cfg = load_config(CFG_72B, ["algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false",
                                "critic.enable=false"])  # fmt: skip
    assert "values" not in phases_of(cfg) and "ref" not in phases_of(cfg)
    assert set(residency(cfg, "generate").models) == {"actor"}


def test_sleep_level_two_unless_the_step_keeps_the_weights():
    cfg = load_config(CFG_72B, ["trainer.skip_weight_sync_steps=[3]"])
    assert sleep_level(cfg, None) == 2  # after the start: the first wake syncs
    assert [sleep_level(cfg, s) for s in (1, 2, 3, 4)] == [2, 2, 1, 2]


def test_an_unknown_phase_is_refused():
    with pytest.raises(ValueError, match="unknown phase 'rollout'"):
        residency(load_config(CFG_72B), "rollout")


def test_vllm_on_ranks_of_its_own_puts_no_engine_on_the_training_devices():
    """Its devices are the rollout ranks' (the models move exactly as colocated)."""
    own = load_config(CFG_72B, ["actor_rollout_ref.rollout.nnodes=1"])
    colocated = load_config(CFG_72B)
    assert phases_of(own) == phases_of(colocated)
    for phase in phases_of(own):
        assert residency(own, phase).engine is None
        assert residency(own, phase).models == residency(colocated, phase).models
