"""``megarl plan`` with LoRA: the actor's gradients and optimizer state are the adapters' alone
(counted by hand here from the adapter shapes), and no reference model is planned."""

from __future__ import annotations

from pathlib import Path

from megarl.config import load_config
from megarl.config.model_dims import ModelDims
from megarl.parallel.layout import ParallelLayout
from megarl.planner.memory import OptimizerAssumptions, chunk_params, model_state

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
DIMS = ModelDims.from_hf_config({
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 128,
    "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 4, "vocab_size": 1000, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
})  # fmt: skip


def test_lora_actor_state_is_base_params_plus_adapters():
    layout, r, t = ParallelLayout(2, 1, None), 8, 2
    h, d, f = 128, 32, 256
    # per layer on a TP rank: qkv A r*h, B (4+2*2)*d/t*r; proj A r*(4*d/t), B h*r;
    # fc1 A r*h, B 2f/t*r; fc2 A r*f/t, B h*r
    per_layer = (r * h + 8 * d // t * r) + (r * 4 * d // t + h * r) + (r * h + 2 * f // t * r) + (
        r * f // t + h * r)  # fmt: skip
    adapters, tensors = 4 * per_layer, 4 * 8
    base = sum(s.numel for s in chunk_params(DIMS, layout, 0))
    opt = OptimizerAssumptions(dtype="fp32", distributed_optimizer=False, adam="torch",
                               impl="local", lora_rank=r)  # fmt: skip
    s = model_state(DIMS, layout, 2, "actor", opt)
    assert (s.params, s.grads, s.main_params) == (4 * (base + adapters), 4 * adapters, 0)
    assert s.optimizer_states == 8 * adapters + 4 * tensors
    full = model_state(DIMS, layout, 2, "actor",
                       OptimizerAssumptions(**{**opt.__dict__, "lora_rank": 0}))  # fmt: skip
    assert full.grads == 4 * base and s.grads < full.grads / 10


def test_plan_has_no_reference_model_with_lora():
    from megarl.planner.memory_plan import _models

    cfg = load_config(CONFIGS / "grpo_lora_tiny_cpu.yaml")
    assert [m.name for m in _models(cfg, DIMS, 2)] == ["actor"]
    cfg = load_config(CONFIGS / "grpo_tiny_cpu.yaml")
    assert [m.name for m in _models(cfg, DIMS, 2)] == ["actor", "ref"]


MOE_DIMS = ModelDims.from_hf_config({
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 128,
    "intermediate_size": 256, "moe_intermediate_size": 64, "num_experts": 8,
    "num_experts_per_tok": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
})  # fmt: skip


def test_lora_moe_actor_counts_expert_adapters_over_expert_dp():
    """Qwen3-MoE at EP 2 of 4 ranks (DP 4, expert-DP 2), rank 4, distributed optimizer: the
    attention adapters' main params and Adam sharded over DP 4, each local expert's adapters
    (fc1 A r*h + B 2F*r, fc2 A r*F + B h*r) over expert-DP 2."""
    layout, r, h, d, f = ParallelLayout(1, 1, None, expert_model_parallel_size=2), 4, 128, 32, 64
    attention = (r * h + 8 * d * r) + (r * 4 * d + h * r)
    experts = 4 * ((r * h + 2 * f * r) + (r * f + h * r))  # the 4 local experts
    opt = OptimizerAssumptions(dtype="fp32", distributed_optimizer=True, adam="fused",
                               impl="local", lora_rank=r)  # fmt: skip
    s = model_state(MOE_DIMS, layout, 4, "actor", opt)
    base = sum(x.numel for x in chunk_params(MOE_DIMS, layout, 0))
    assert s.params >= 4 * (base + 2 * (attention + experts))
    assert s.grads >= 4 * 2 * (attention + experts)  # (the buffers' padding on top)
    want_adam = 8 * (2 * attention / 4 + 2 * experts / 2)
    assert want_adam <= s.optimizer_states <= want_adam * 1.05, (s.optimizer_states, want_adam)
    assert s.experts.optimizer_states >= 8 * 2 * experts / 2
    frozen = sum(x.numel for x in chunk_params(MOE_DIMS, layout, 0) if x.expert)
    assert 4 * (frozen + 2 * experts) <= s.experts.params <= 4.05 * (frozen + 2 * experts)
