"""Every file in configs/ resolves and validates at its intended world size and round-trips."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megarl.config import ConfigError, load_config, to_yaml, validate, world_size

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
INTENDED_WORLD_SIZE = {
    "grpo_tiny_cpu.yaml": 2,
    "grpo_moe_tiny_cpu.yaml": 2,
    "grpo_lora_tiny_cpu.yaml": 2,
    "grpo_tools_tiny_cpu.yaml": 2,
    "grpo_tiny_vl_cpu.yaml": 2,
    "opd_tiny_cpu.yaml": 1,  # training ranks; its teacher rank comes on top
    "ppo_tiny_cpu.yaml": 2,
    "grpo_qwen2_5_7b.yaml": 8,
    "grpo_qwen3_30b_a3b.yaml": 16,
    "ppo_qwen2_5_32b.yaml": 32,
    "grpo_qwen2_5_32b_longcot.yaml": 32,
    "ppo_qwen2_5_72b.yaml": 64,
}
RUNNABLE = sorted(p.name for p in CONFIGS.glob("*.yaml") if not p.name.startswith("_"))
PARTIAL = sorted(p.name for p in CONFIGS.glob("_*.yaml"))


def test_every_runnable_config_has_an_intended_world_size():
    assert RUNNABLE == sorted(INTENDED_WORLD_SIZE)
    assert PARTIAL  # the shared bases exist


@pytest.mark.parametrize("name", RUNNABLE)
def test_config_validates_at_its_world_size(name):
    cfg = load_config(CONFIGS / name)
    warnings = validate(cfg, INTENDED_WORLD_SIZE[name])
    # the only expected warnings: model files are absent here, the architecture section is used;
    # a file the config names relative to the repository (the run's directory) is not found here;
    # opd_tiny_cpu's teacher is what make demo writes under outputs/
    layout = [w for w in warnings if "checking the layout against" in w or _repo_file(w)
              or re.search(r"'outputs/[^']+' does not exist \(the teacher loads", w)]  # fmt: skip
    assert len(layout) == len(warnings), warnings


def _repo_file(warning: str) -> bool:
    found = re.search(r"'([^']+)' does not exist$", warning)
    return found is not None and (CONFIGS.parent / found.group(1)).is_file()


@pytest.mark.parametrize("name", RUNNABLE)
def test_config_fails_at_another_world_size(name):
    cfg = load_config(CONFIGS / name)
    with pytest.raises(ConfigError, match="world size"):
        validate(cfg, INTENDED_WORLD_SIZE[name] * 2)


@pytest.mark.parametrize("name", RUNNABLE + PARTIAL)
def test_config_round_trips_through_yaml(name, tmp_path):
    cfg = load_config(CONFIGS / name)
    dumped = tmp_path / "resolved.yaml"
    dumped.write_text(to_yaml(cfg))
    assert load_config(dumped) == cfg


def test_tiny_configs_run_on_two_cpu_processes_in_fp32():
    for name in ("grpo_tiny_cpu.yaml", "ppo_tiny_cpu.yaml"):
        cfg = load_config(CONFIGS / name)
        t = cfg.trainer
        assert (t.nnodes, t.n_gpus_per_node, t.device, t.dtype) == (1, 2, "cpu", "fp32")
        assert cfg.actor_rollout_ref.model.path == "outputs/tiny-qwen2"
        assert cfg.actor_rollout_ref.actor.megatron.transformer_impl == "local"
        assert cfg.actor_rollout_ref.rollout.tensor_model_parallel_size == 2
    grpo = load_config(CONFIGS / "grpo_tiny_cpu.yaml")
    assert grpo.algorithm.adv_estimator == "grpo" and grpo.actor_rollout_ref.rollout.n >= 2
    ppo = load_config(CONFIGS / "ppo_tiny_cpu.yaml")
    assert ppo.algorithm.adv_estimator == "gae"
    assert ppo.actor_rollout_ref.actor.megatron.pipeline_model_parallel_size == 2
    assert ppo.critic.megatron.pipeline_model_parallel_size == 2  # inherited from the actor


def test_grpo_7b_respects_the_four_kv_heads():
    cfg = load_config(CONFIGS / "grpo_qwen2_5_7b.yaml")
    arch = cfg.actor_rollout_ref.model.architecture
    assert (arch.num_attention_heads, arch.num_key_value_heads, arch.num_hidden_layers) == (
        28,
        4,
        28,
    )
    assert cfg.actor_rollout_ref.actor.megatron.tensor_model_parallel_size <= 4
    assert world_size(cfg) == 8


@pytest.mark.parametrize(
    ("name", "heads", "kv", "layers", "nodes"),
    [("ppo_qwen2_5_32b.yaml", 40, 8, 64, 4), ("ppo_qwen2_5_72b.yaml", 64, 8, 80, 8)],
)
def test_large_ppo_configs(name, heads, kv, layers, nodes):
    cfg = load_config(CONFIGS / name)
    arch = cfg.actor_rollout_ref.model.architecture
    assert (arch.num_attention_heads, arch.num_key_value_heads) == (heads, kv)
    assert (arch.num_hidden_layers, arch.vocab_size) == (layers, 152064)
    assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node) == (nodes, 8)
    assert cfg.algorithm.adv_estimator == "gae"
    for meg in (cfg.actor_rollout_ref.actor.megatron, cfg.critic.megatron):
        assert meg.tensor_model_parallel_size == 8 and meg.pipeline_model_parallel_size >= 2


def test_72b_rollout_uses_tp_8():
    cfg = load_config(CONFIGS / "ppo_qwen2_5_72b.yaml")
    assert cfg.actor_rollout_ref.rollout.tensor_model_parallel_size == 8


def test_grpo_qwen3_30b_a3b_is_an_expert_parallel_layout_that_fits():
    """EP 8 × expert TP 1 (16 experts per GPU, expert DP 2) beside TP 4 with sequence
    parallelism (Megatron requires it with TP and EP) × PP 1 on 2 nodes; ``megarl plan`` says
    it fits there (its model shape: the qwen3-30b-a3b preset its hub id names)."""
    from megarl.planner.memory_plan import Cluster, plan_memory
    from megarl.planner.model_presets import resolve_dims

    cfg = load_config(CONFIGS / "grpo_qwen3_30b_a3b.yaml")
    arch = cfg.actor_rollout_ref.model.architecture
    assert (arch.architecture, arch.num_experts, arch.num_hidden_layers) == (
        "Qwen3MoeForCausalLM",
        128,
        48,
    )
    meg = cfg.actor_rollout_ref.actor.megatron
    assert (meg.tensor_model_parallel_size, meg.pipeline_model_parallel_size) == (4, 1)
    assert (meg.expert_model_parallel_size, meg.expert_tensor_parallel_size) == (8, 1)
    assert meg.sequence_parallel
    assert meg.override_transformer_config == {"moe_token_dispatcher_type": "alltoall"}
    assert world_size(cfg) == 16
    dims, source = resolve_dims(cfg.actor_rollout_ref.model, 4)
    assert source.startswith("preset qwen3-30b-a3b") and dims.num_experts == 128
    assert plan_memory(cfg, dims, Cluster(2, 8)).fits
