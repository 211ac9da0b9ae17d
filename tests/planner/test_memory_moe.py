"""The memory planner on Mixture-of-Experts models: expert parameters, gradients and optimizer
state per expert-parallel rank, against hand counts from the HF shapes (and, for the presets,
the published totals), the resharding plan's shard shapes, and ``megarl plan``'s verdicts."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.commands import plan as plan_cli
from megarl.config import load_config
from megarl.config.model_dims import ModelDims
from megarl.models.tiny import tiny_hf_config
from megarl.parallel.layout import ParallelLayout
from megarl.planner.activations import layer_bytes_per_token
from megarl.planner.memory import (
    OptimizerAssumptions,
    chunk_params,
    grad_buffer,
    layer_experts_bytes,
    model_state,
    vllm_weight_bytes,
)
from megarl.planner.memory_plan import Cluster, plan_memory
from megarl.planner.model_presets import PRESETS
from megarl.rollout.reshard.make_plan import make_reshard_plan

CFG_30B = str(Path(__file__).resolve().parents[2] / "configs" / "grpo_qwen3_30b_a3b.yaml")
MEG = "actor_rollout_ref.actor.megatron"
OPT = OptimizerAssumptions()  # bf16, fp32 gradient buffers, distributed optimizer, FusedAdam


def _layout(tp=1, pp=1, ep=1, etp=None) -> ParallelLayout:
    return ParallelLayout(tp, pp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)


def _hand_count(hf: dict) -> tuple[int, int, int]:
    """(total, activated, routed-expert) parameters from the HF config.json fields alone."""
    h, layers, v = hf["hidden_size"], hf["num_hidden_layers"], hf["vocab_size"]
    heads, kv, d = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    experts, k, width = hf["num_experts"], hf["num_experts_per_tok"], hf["moe_intermediate_size"]
    attention = h * heads * d + 2 * h * kv * d + heads * d * h + 2 * d  # q, k, v, o, q/k norms
    one_expert = 3 * width * h  # gate, up, down
    router, norms = experts * h, 2 * h
    embeddings = v * h * (1 if hf["tie_word_embeddings"] else 2) + h  # + final norm
    total = layers * (attention + experts * one_expert + router + norms) + embeddings
    active = layers * (attention + k * one_expert + router + norms) + embeddings
    return total, active, layers * experts * one_expert


@pytest.mark.parametrize(
    ("preset", "total_b", "active_b"), [("qwen3-30b-a3b", 30.5, 3.3), ("qwen3-235b-a22b", 235, 22)]
)
def test_presets_match_the_published_parameter_counts(preset, total_b, active_b):
    """Qwen's model cards: Qwen3-30B-A3B 30.5B total / 3.3B activated, Qwen3-235B-A22B
    235B / 22B. The hand count from the preset's shape lands on both (within 1 %), and the
    planner's parameter list on one rank of a TP1·PP1·EP1 layout is exactly the hand count."""
    hf = PRESETS[preset]
    total, active, _ = _hand_count(hf)
    assert total == pytest.approx(total_b * 1e9, rel=0.01)
    assert active == pytest.approx(active_b * 1e9, rel=0.03)
    dims = ModelDims.from_hf_config(hf)
    assert sum(s.numel for s in chunk_params(dims, _layout(), 0)) == total


def test_expert_state_per_ep_rank_equals_the_hand_count():
    """Qwen3-30B-A3B on 16 GPUs at TP 4 × PP 1, EP 8 × expert TP 1 (the shipped config):
    each rank holds 128/8 = 16 experts of every one of the 48 layers, whole (ETP 1):
      n_e = 48 · 16 · 3 · 768 · 2048 = 3,623,878,656 elements (a multiple of 128: no padding).
    Expert DP = 16 / (1 · 8 · 1) = 2, so the rank updates n_e/2 of them:
      params 2·n_e (bf16), gradient buffer 4·n_e (fp32), main params 4·n_e/2, Adam 8·n_e/2."""
    n_e = 48 * 16 * 3 * 768 * 2048
    assert n_e == 3_623_878_656 and n_e == _hand_count(PRESETS["qwen3-30b-a3b"])[2] // 8
    dims = ModelDims.from_hf_config(PRESETS["qwen3-30b-a3b"])
    layout = _layout(tp=4, ep=8, etp=1)
    slots = chunk_params(dims, layout, 0)
    assert sum(s.numel for s in slots if s.expert) == n_e
    assert sum(1 for s in slots if s.expert) == 48 * 16 * 2  # linear_fc1, linear_fc2 per expert
    state = model_state(dims, layout, 16, "actor", OPT)
    e = state.experts
    assert (e.params, e.grads, e.main_params, e.optimizer_states) == (
        2 * n_e,
        4 * n_e,
        4 * n_e // 2,
        8 * n_e // 2,
    )
    # the dense part: attention, norms, router (replicated over TP) and the vocab-parallel
    # embedding and output layer, at TP 4, sharded over DP 4 by the distributed optimizer
    dense = state.params // 2 - n_e
    per_layer = (32 + 2 * 4) * 128 // 4 * 2048 + 2048 * 32 * 128 // 4 + 2 * 128 + 2 * 2048
    per_layer += 128 * 2048  # the router
    unpadded = 48 * per_layer + 2 * 152064 // 4 * 2048 + 2048  # vocab padded to 512·297
    assert 0 <= dense - unpadded < 64 * 48 * 8 + 128  # 64-element starts, lcm(4, 128) end


def test_ep_halves_the_expert_bytes_per_rank():
    """Doubling EP on the same 16 GPUs halves each rank's experts (params, gradients); their
    optimizer state stays: it is sharded over expert DP, which halves as EP doubles."""
    dims = ModelDims.from_hf_config(PRESETS["qwen3-30b-a3b"])
    ep4 = model_state(dims, _layout(tp=4, ep=4, etp=1), 16, "actor", OPT).experts
    ep8 = model_state(dims, _layout(tp=4, ep=8, etp=1), 16, "actor", OPT).experts
    assert (ep4.params, ep4.grads) == (2 * ep8.params, 2 * ep8.grads)
    assert ep4.main_params + ep4.optimizer_states == ep8.main_params + ep8.optimizer_states
    # vLLM keeps every expert whatever the training EP
    assert vllm_weight_bytes(dims, 4) > 30e9 * 2 / 4


def test_expert_optimizer_state_divides_by_expert_dp_not_dp():
    """TP 4, EP 8, ETP 1: DP = world/4, expert DP = world/8. From 16 to 32 GPUs the experts'
    Adam state halves (expert DP 2 → 4) and their parameters stay; at 16 GPUs it is the
    n_e·12/2 of expert DP 2, not the n_e·12/4 that DP 4 would give."""
    dims = ModelDims.from_hf_config(PRESETS["qwen3-30b-a3b"])
    layout = _layout(tp=4, ep=8, etp=1)
    at16 = model_state(dims, layout, 16, "actor", OPT)
    at32 = model_state(dims, layout, 32, "actor", OPT)
    assert layout.data_parallel_size(16) == 4
    n_e = at16.experts.params // 2
    assert at16.experts.main_params + at16.experts.optimizer_states == 12 * n_e // 2
    assert at32.experts.optimizer_states * 2 == at16.experts.optimizer_states
    assert at32.experts.params == at16.experts.params
    # the dense part is sharded over DP (4 → 8), not over expert DP
    dense16 = at16.optimizer_states - at16.experts.optimizer_states
    dense32 = at32.optimizer_states - at32.experts.optimizer_states
    assert dense32 == pytest.approx(dense16 / 2, rel=1e-3)


def test_at_ep1_the_experts_share_the_dense_buffers():
    """Megatron turns ``allreduce`` off only for expert-parallel layers: at EP 1 the experts
    sit in the dense buffer, reduced and sharded over DP."""
    dims = ModelDims.from_hf_config(tiny_hf_config("qwen3_moe"))
    n_e = sum(s.numel for s in chunk_params(dims, _layout(), 0) if s.expert)
    ranks = [model_state(dims, _layout(), 4, "actor", OPT, pp_rank=0, dp_rank=r) for r in range(4)]
    assert all(r.experts.params == 2 * n_e for r in ranks)  # no padding of their own
    assert sum(r.experts.main_params + r.experts.optimizer_states for r in ranks) == 12 * n_e
    # one buffer: its padding (lcm(4, 128) at the end) is counted once, with the dense part
    slots = chunk_params(dims, _layout(), 0)
    assert ranks[0].params == 2 * grad_buffer(slots, 4, True).numel


def test_router_and_the_shared_expert_are_counted():
    """Qwen2-MoE (tiny): per layer the router ``E × h``, ``E/EP`` experts split over expert TP,
    the shared expert split over TP (``2F_s/t × h``, ``h × F_s/t``) and its ``1 × h`` gate."""
    hf = tiny_hf_config("qwen2_moe")
    dims = ModelDims.from_hf_config(hf)
    h, e, f, fs = 128, hf["num_experts"], hf["moe_intermediate_size"], 2 * 64
    layout = _layout(tp=2, ep=2, etp=1)
    layer = {
        s.name.split(".", 3)[3]: s.numel
        for s in chunk_params(dims, layout, 0)
        if s.name.startswith("decoder.layers.0.mlp.")
    }
    expected = {"mlp.router.weight": e * h}
    for j in range(e // 2):
        expected[f"mlp.experts.local_experts.{j}.linear_fc1.weight"] = 2 * f * h
        expected[f"mlp.experts.local_experts.{j}.linear_fc2.weight"] = h * f
    expected["mlp.shared_experts.linear_fc1.weight"] = 2 * fs // 2 * h
    expected["mlp.shared_experts.linear_fc2.weight"] = h * fs // 2
    expected["mlp.shared_experts.gate_weight"] = h
    assert layer == expected


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
@pytest.mark.parametrize(
    ("tp", "pp", "ep", "etp"), [(1, 1, 1, None), (2, 1, 2, None), (1, 2, 4, None), (2, 2, 2, 1)]
)
def test_rank_parameters_equal_the_resharding_plans_shards(family, tp, pp, ep, etp):
    """Every (stage, EP rank): the planner's elements = the shard shapes the resharding plan
    (written independently, from the HF↔Megatron mapping) assigns to that rank."""
    dims = ModelDims.from_hf_config(tiny_hf_config(family), tp_size=tp)
    layout = _layout(tp, pp, ep, etp)
    plan = make_reshard_plan(dims, layout, 1)
    for stage in range(pp):
        for ep_rank in range(ep):
            reshard = sum(
                _numel(p.shard_shape)
                for p in plan.params.values()
                if p.pp_rank == stage and p.ep_rank in (None, ep_rank)
            )
            assert sum(s.numel for s in chunk_params(dims, layout, stage)) == reshard


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


@pytest.mark.parametrize(
    "hf",
    [
        tiny_hf_config("qwen3_moe"),
        tiny_hf_config("mixtral"),
        tiny_hf_config("qwen2_moe"),
        tiny_hf_config("qwen3_moe", num_experts=16, moe_intermediate_size=96),
    ],
    ids=["qwen3_moe", "mixtral", "qwen2_moe", "qwen3_moe_16"],
)
@pytest.mark.parametrize("rollout_tp", [1, 2, 4])
def test_vllm_moe_weight_bytes_equal_the_resharding_plans(hf, rollout_tp):
    """vLLM keeps every expert, its intermediate dimension split over the rollout TP."""
    dims = ModelDims.from_hf_config(hf)
    reshard = make_reshard_plan(dims, _layout(), rollout_tp)
    assert vllm_weight_bytes(dims, rollout_tp, 2) == reshard.rollout_bytes_per_rank()
    # a layer's experts travel as one bucket however small the bucket limit
    one_module = make_reshard_plan(dims, _layout(ep=2), rollout_tp, bucket_bytes=1)
    assert max(b.nbytes for b in one_module.buckets) >= layer_experts_bytes(dims, 2)
    assert layer_experts_bytes(dims, 2) in {b.nbytes for b in one_module.buckets}


def test_moe_layer_activations_follow_top_k():
    """TE spec, TP 4 with sequence parallelism, EP 8, ETP 1: per token of the micro-batch a
    MoE layer saves the router's fp32 tensors ``(4h + 9E + 4k)/4`` and, for the
    ``k·1/4`` routed pairs per token this rank computes, ``2·(2h + 3F_e)`` bytes each."""
    dims = ModelDims.from_hf_config(PRESETS["qwen3-30b-a3b"])
    h, e, k, f = 2048, 128, 8, 768
    layout = ParallelLayout(4, 1, expert_model_parallel_size=8, sequence_parallel=True,
                            expert_tensor_parallel_size=1)  # fmt: skip
    per_token = layer_bytes_per_token(dims, layout, 4096, "bf16", "transformer_engine")
    attention = 2 * (4 * h / 4 + ((32 + 8) * 128 + 32 * 128) / 4) + 8 / 4 + 4 * 32 / 4
    moe = (4 * h + 9 * e + 4 * k) / 4 + k / 4 * 2 * (2 * h + 3 * f)
    assert per_token == pytest.approx(attention + moe)
    # EP spreads experts, not tokens: the per-rank activations do not depend on it
    other = ParallelLayout(4, 1, expert_model_parallel_size=2, sequence_parallel=True,
                           expert_tensor_parallel_size=1)  # fmt: skip
    assert layer_bytes_per_token(dims, other, 4096, "bf16", "transformer_engine") == per_token


def test_the_30b_config_fits_on_two_nodes_and_not_on_one():
    dims = ModelDims.from_hf_config(PRESETS["qwen3-30b-a3b"])
    cfg = load_config(CFG_30B)
    meg = cfg.actor_rollout_ref.actor.megatron
    assert (meg.tensor_model_parallel_size, meg.expert_model_parallel_size) == (4, 8)
    assert plan_memory(cfg, dims, Cluster(2, 8)).fits
    one = plan_memory(cfg, dims, Cluster(1, 8))
    assert not one.fits
    update = next(p for p in one.phases if p.name == "update_actor")
    biggest = max(update.terms, key=lambda t: t.nbytes)
    assert biggest.name == "actor expert fp32 main params + Adam moments"
    assert biggest.nbytes == 12 * 48 * 16 * 3 * 768 * 2048  # 16 experts per rank, expert DP 1


def test_the_235b_preset_on_8_and_16_nodes():
    """TP 4 × PP 2 (94 layers allow no more than 2 stages), EP 32, ETP 1, full recompute,
    vLLM TP 16: 8 nodes do not fit (expert DP 1: the experts' Adam state alone is ~40 GiB);
    16 nodes do (expert DP 2)."""
    dims = ModelDims.from_hf_config(PRESETS["qwen3-235b-a22b"])
    overrides = [
        f"{MEG}.pipeline_model_parallel_size=2",
        f"{MEG}.expert_model_parallel_size=32",
        f"{MEG}.recompute_granularity=full",
        f"{MEG}.recompute_method=uniform",
        f"{MEG}.recompute_num_layers=1",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=16",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.7",
    ]
    cfg = load_config(CFG_30B, overrides)
    eight = plan_memory(cfg, dims, Cluster(8, 8))
    assert not eight.fits
    assert "biggest term: actor expert fp32 main params + Adam moments" in eight.reason()
    assert plan_memory(cfg, dims, Cluster(16, 8)).fits


def test_plan_cli_names_the_verdict_and_its_reason(capsys):
    assert plan_cli.main(["--config", CFG_30B, "--preset", "qwen3-30b-a3b"]) == 0
    out = capsys.readouterr().out
    assert "experts: EP 8 × expert TP 1 × PP 1 → expert DP 2" in out
    assert "actor expert gradient buffers" in out
    verdict = next(line for line in out.splitlines() if line.startswith("verdict:"))
    assert verdict.startswith("verdict: FITS: peak update_actor needs"), verdict
    assert plan_cli.main(["--config", CFG_30B, "--preset", "qwen3-30b-a3b", "--nodes", "1"]) == 0
    out = capsys.readouterr().out
    verdict = next(line for line in out.splitlines() if line.startswith("verdict:"))
    assert verdict.startswith("verdict: DOES NOT FIT: update_actor needs"), verdict
    assert "biggest term: actor expert fp32 main params + Adam moments" in verdict
    assert "× EP " in out  # the proposals name their expert layout
