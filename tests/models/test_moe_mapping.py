"""MoE (Qwen3-MoE, Mixtral) shapes, names and layout rules: pure functions, one process."""

from __future__ import annotations

import re

import pytest
import torch

from megarl.config.model_dims import ModelDims, UnsupportedArchitectureError
from megarl.models import hf_mapping as hm
from megarl.models import moe_mapping as mm
from megarl.models.gpt import MoeSettings, moe_config_fields
from megarl.models.tiny import random_hf_state, tiny_hf_config
from megarl.parallel.layout import ParallelLayout, shape_layout_problems


def _dims(family: str, **kw) -> ModelDims:
    return ModelDims.from_hf_config(tiny_hf_config(family, **kw))


def test_router_settings_follow_each_family():
    qwen, mixtral = _dims("qwen3_moe"), _dims("mixtral", moe_intermediate_size=96)
    assert (qwen.num_experts, qwen.moe_router_topk, qwen.moe_ffn_hidden_size) == (8, 2, 64)
    assert qwen.qk_norm and qwen.moe_renormalize_topk
    assert not _dims("qwen3_moe", norm_topk_prob=False).moe_renormalize_topk
    assert (mixtral.num_experts, mixtral.moe_ffn_hidden_size, mixtral.ffn_hidden_size) == (
        8,
        96,
        96,
    )
    assert mixtral.moe_renormalize_topk and not mixtral.qk_norm
    fields = moe_config_fields(
        qwen, MoeSettings(), expert_model_parallel_size=2, expert_tensor_parallel_size=1,
        transformer_engine=False,
    )  # fmt: skip
    assert fields["moe_router_pre_softmax"] is False  # softmax over the top-k = renormalised
    assert fields["moe_router_dtype"] == "fp32" and fields["moe_router_topk"] == 2
    unnormalised = _dims("qwen3_moe", norm_topk_prob=False)
    assert moe_config_fields(
        unnormalised, MoeSettings(), expert_model_parallel_size=1, expert_tensor_parallel_size=1,
        transformer_engine=True,
    )["moe_router_pre_softmax"] is True  # fmt: skip


def test_verl_moe_knobs_pass_through_and_bad_ones_are_named():
    knobs = {
        "moe_aux_loss_coeff": 0.01,
        "moe_z_loss_coeff": 0.001,
        "moe_token_dispatcher_type": "allgather",
        "moe_expert_capacity_factor": 1.5,
        "moe_token_drop_policy": "position",
    }
    fields = moe_config_fields(
        _dims("mixtral"), MoeSettings.from_dict(knobs), expert_model_parallel_size=1,
        expert_tensor_parallel_size=1, transformer_engine=False,
    )  # fmt: skip
    assert {k: fields[k] for k in knobs} == knobs
    for bad, needle in [
        ({"moe_no_such_knob": 1}, "not a TransformerConfig moe_* field"),
        ({"hidden_dropout": 0.1}, "not a TransformerConfig moe_* field"),
        ({"moe_router_topk": 4}, "the router follows the HF config"),
        ({"moe_token_dispatcher_type": "flex"}, "alltoall, allgather"),
    ]:
        with pytest.raises(ValueError, match=re.escape(needle)):
            MoeSettings.from_dict(bad).checked()


def test_unsupported_moe_variants_are_named():
    with pytest.raises(UnsupportedArchitectureError, match="decoder_sparse_step=2"):
        ModelDims.from_hf_config(tiny_hf_config("qwen3_moe") | {"decoder_sparse_step": 2})
    with pytest.raises(UnsupportedArchitectureError, match="router_jitter_noise"):
        ModelDims.from_hf_config(tiny_hf_config("mixtral") | {"router_jitter_noise": 0.01})
    with pytest.raises(UnsupportedArchitectureError, match="sliding_window"):
        ModelDims.from_hf_config(tiny_hf_config("mixtral") | {"sliding_window": 4096})


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_hf_megatron_round_trip_is_bit_identical(family):
    dims = _dims(family)
    hf = random_hf_state(dims, seed=5)
    router = "block_sparse_moe.gate.weight" if family == "mixtral" else "mlp.gate.weight"
    assert hf[f"model.layers.0.{router}"].shape == (8, 128)
    mg = hm.hf_to_megatron(hf, dims)
    assert list(mg) == hm.megatron_param_names(dims)
    assert "decoder.layers.0.mlp.linear_fc1.weight" not in mg  # no dense MLP
    fc1 = mg["decoder.layers.3.mlp.experts.local_experts.7.linear_fc1.weight"]
    assert fc1.shape == (128, 128)  # [gate_7; up_7], 64 rows each
    gate = (
        "block_sparse_moe.experts.7.w1.weight"
        if family == "mixtral"
        else "mlp.experts.7.gate_proj.weight"
    )
    assert torch.equal(fc1[:64], hf[f"model.layers.3.{gate}"])
    shared = "decoder.layers.0.mlp.shared_experts.gate_weight"
    assert (shared in mg) == (family == "qwen2_moe")
    if family == "qwen2_moe":  # the shared expert is TP-split like a dense MLP, its gate is not
        assert hm.tp_partition_kind(shared) == "replicated" and dims.qkv_bias
        assert mg["decoder.layers.0.mlp.shared_experts.linear_fc1.weight"].shape == (256, 128)
    back = hm.megatron_to_hf(mg, dims)
    assert sorted(back) == sorted(hf)
    assert all(torch.equal(back[k], v) for k, v in hf.items())


def test_expert_shards_split_over_expert_tp_and_merge_back():
    dims = _dims("qwen3_moe")
    mg = hm.hf_to_megatron(random_hf_state(dims, seed=6), dims)
    for name in (
        "decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight",
        "decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight",
        "decoder.layers.1.mlp.router.weight",
    ):
        shards = [hm.tp_split(name, mg[name], 2, r, dims) for r in range(2)]
        assert torch.equal(hm.tp_merge(name, shards, dims), mg[name])
    assert hm.tp_partition_kind("decoder.layers.1.mlp.router.weight") == "replicated"
    fc1 = "decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight"
    gate, up = mg[fc1].chunk(2)
    assert torch.equal(hm.tp_split(fc1, mg[fc1], 2, 1, dims), torch.cat([gate[32:], up[32:]]))


def test_expert_indices_and_transformer_engine_names():
    local = "decoder.layers.4.mlp.experts.local_experts.1.linear_fc2.weight"
    glob = mm.expert_name_to_global(local, ep_rank=3, num_local_experts=2)
    assert glob == "decoder.layers.4.mlp.experts.local_experts.7.linear_fc2.weight"
    assert mm.expert_name_to_local(glob, 3, 2) == local
    with pytest.raises(ValueError, match="not on expert-parallel rank 0"):
        mm.expert_name_to_local(glob, 0, 2)
    assert mm.is_expert_param(glob) and not mm.is_expert_param("decoder.layers.4.mlp.router.weight")
    te = "decoder.layers.4.mlp.experts.linear_fc2.weight1"
    assert hm.from_te_name(te) == local and hm.to_te_name(local, moe=True) == te
    norm = "decoder.layers.4.pre_mlp_layernorm.weight"  # its own module in TE MoE layers
    assert hm.to_te_name(norm, moe=True) == norm != hm.to_te_name(norm)


def test_impossible_expert_layouts_are_refused_naming_the_sizes():
    moe = _dims("qwen3_moe").known()  # 8 experts, expert width 64

    def problems(shape, **sizes):
        return [p.describe() for p in shape_layout_problems(ParallelLayout(**sizes), shape)]

    assert problems(moe, expert_model_parallel_size=8, tensor_model_parallel_size=2) == []
    assert problems(moe, expert_model_parallel_size=3) == [
        "EP=3 does not divide the model's 8 experts"
    ]
    assert problems({**moe, "moe_ffn_hidden_size": 60}, expert_tensor_parallel_size=8) == [
        "ETP=8 does not divide the experts' intermediate size 60"
    ]
    dense = _dims("qwen2").known()
    assert problems(dense, expert_model_parallel_size=4) == ["EP=4 but the model is dense"]
    layout = ParallelLayout(2, 2, expert_model_parallel_size=4, expert_tensor_parallel_size=1)
    # dense TP×PP = 4 ranks per replica, experts ETP×EP×PP = 8: world 8, DP 2, expert DP 1
    assert layout.world_size() == 8 and layout.data_parallel_size(8) == 2
    with pytest.raises(ValueError, match=r"expert_model_parallel_size × .* = 1×4×2"):
        layout.data_parallel_size(4)


def test_a_moe_model_trains_at_ep_and_needs_sequence_parallel_at_tp(tmp_path):
    """``megarl train``'s validation (paths checked) takes a MoE model at TP 1 × EP 2; at TP 2
    it names the sequence-parallel key (Megatron trains MoE layers at TP > 1 only with it)."""
    from megarl.commands import data
    from megarl.config import ConfigError, load_config, validate
    from megarl.models.tiny import make_tiny_model

    make_tiny_model(tmp_path / "moe", family="qwen3_moe")
    assert data.main(["synth", "--out", str(tmp_path / "data"), "--train-size", "64"]) == 0
    files = [
        f"actor_rollout_ref.model.path={tmp_path / 'moe'}",
        f"data.train_files={tmp_path / 'data' / 'train.parquet'}",
        f"data.val_files={tmp_path / 'data' / 'test.parquet'}",
    ]
    cfg = load_config(["configs/grpo_tiny_cpu.yaml"], files)  # TP 2, no sequence parallelism
    with pytest.raises(
        ConfigError,
        match=r"Mixture-of-Experts model: .*tensor_model_parallel_siz"
        r"e=2 needs actor_rollout_ref.actor.megatron.sequence_parallel=true",
    ):
        validate(cfg, 2, check_paths=True)  # fmt: skip
    meg = "actor_rollout_ref.actor.megatron"
    cfg = load_config(
        ["configs/grpo_tiny_cpu.yaml"],
        [*files, f"{meg}.tensor_model_parallel_size=1", f"{meg}.expert_model_parallel_size=2"],
    )
    warnings = validate(cfg, 2, check_paths=True)
    assert not any("Mixture-of-Experts" in w for w in warnings), warnings
