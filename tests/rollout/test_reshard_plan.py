"""The resharding plan is pure: checked here without processes, Megatron or vLLM."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megarl.commands import plan as plan_cli
from megarl.config.model_dims import ModelDims
from megarl.models import hf_mapping as hm
from megarl.models.tiny import tiny_hf_config
from megarl.parallel.layout import ParallelLayout
from megarl.rollout.reshard.plan import (
    chunk_layer_range,
    make_reshard_plan,
    owner_of,
)

LAYOUTS = [(1, 1, None), (2, 1, None), (1, 2, None), (2, 2, None), (1, 4, None), (2, 2, 2)]


def tiny_dims(family="qwen2", tp=1, **kw) -> ModelDims:
    return ModelDims.from_hf_config(tiny_hf_config(family, **kw), tp_size=tp)


def qwen72b_dims(tp: int = 8) -> ModelDims:
    return ModelDims.from_hf_config(plan_cli.PRESETS["qwen2.5-72b"], tp_size=tp)


def _plan(dims_kw: dict, layout, rollout_tp=1, bucket_bytes=64 << 10, **kw):
    tp, pp, vpp = layout
    dims = tiny_dims(tp=tp, **dims_kw)
    return make_reshard_plan(
        dims, ParallelLayout(tp, pp, vpp), rollout_tp, bucket_bytes=bucket_bytes, **kw
    )


MODELS = {
    "qwen2": {"family": "qwen2", "num_layers": 8},
    "llama_tied": {"family": "llama", "num_layers": 8, "tie_word_embeddings": True},
    "qwen3": {"family": "qwen3", "num_layers": 8},
}


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_parameter_once_and_hf_names_cover_the_model(model, layout):
    plan = _plan(MODELS[model], layout)
    dims = plan.dims
    names = [p.name for b in plan.buckets for p in b.params]
    assert names == hm.megatron_param_names(dims)  # Megatron's global order, tied output skipped
    slots = [s.name for b in plan.buckets for s in b.slots]
    assert sorted(slots) == sorted(hm.hf_param_names(dims))
    assert len(set(slots)) == len(slots)
    for b in plan.buckets:
        for s in b.slots:
            assert s.shape == hm.hf_param_shape(s.name, dims)
    # the last stage's copy of a tied embedding (PP > 1) sends nothing
    tied_copy = dims.tie_word_embeddings and layout[1] > 1
    assert plan.skipped == ((hm.OUTPUT_LAYER,) if tied_copy else ())
    assert ("lm_head.weight" in slots) == (not dims.tie_word_embeddings)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bucket_kib", [1, 64, 300, 100_000])
def test_buckets_bounded_single_stage_whole_modules_contiguous(layout, bucket_kib):
    plan = _plan(MODELS["qwen2"], layout, bucket_bytes=bucket_kib << 10)
    module_bucket: dict[str, int] = {}
    for b in plan.buckets:
        modules = {p.name.rsplit(".", 1)[0] for p in b.params}
        # over the limit only when the bucket is a single module
        assert b.nbytes <= plan.bucket_bytes or len(modules) == 1
        assert {p.pp_rank for p in b.params} == {b.pp_rank}
        for m in modules:
            assert module_bucket.setdefault(m, b.index) == b.index  # never split
        offset = 0
        for s in b.slots:
            assert s.offset == offset
            offset += s.span
        assert offset == b.numel
        assert b.peak_bytes == b.nbytes + b.scratch_bytes
    # qkv weight and bias (one vLLM module) always share a bucket
    assert module_bucket["decoder.layers.0.self_attention.linear_qkv"] is not None
    assert plan.peak_bytes == max(b.peak_bytes for b in plan.buckets)
    # vocab-parallel tensors travel alone (vLLM may hold them until the update finishes)
    for b in plan.buckets:
        if any(p.partition == "vocab" for p in b.params):
            assert len(b.params) == 1
    if bucket_kib == 100_000:  # embedding | one per model chunk (+ final norm) | lm_head
        assert len(plan.buckets) == 2 + layout[1] * (layout[2] or 1)


def test_same_plan_every_time():
    a = _plan(MODELS["qwen2"], (2, 2, 2), rollout_tp=2)
    b = _plan(MODELS["qwen2"], (2, 2, 2), rollout_tp=2)
    assert a == b
    assert [s.offset for x in a.buckets for s in x.slots] == [
        s.offset for x in b.buckets for s in x.slots
    ]


def test_even_split_ownership_by_hand():
    dims = qwen72b_dims()
    lay = ParallelLayout(8, 4)
    assert owner_of("decoder.layers.19.mlp.linear_fc2.weight", dims, lay) == (0, 0)
    assert owner_of("decoder.layers.20.input_layernorm.weight", dims, lay) == (1, 0)
    assert owner_of("decoder.layers.79.mlp.linear_fc1.weight", dims, lay) == (3, 0)
    assert owner_of(hm.EMBEDDING, dims, lay) == (0, 0)
    assert owner_of(hm.OUTPUT_LAYER, dims, lay) == (3, 0)
    # VPP: 8 layers, PP 2, VPP 2 -> chunks of 2 layers: s0c0, s1c0, s0c1, s1c1
    d8 = tiny_dims(num_layers=8)
    v = ParallelLayout(1, 2, 2)
    owners = [owner_of(f"decoder.layers.{i}.input_layernorm.weight", d8, v) for i in range(8)]
    assert owners == [(0, 0), (0, 0), (1, 0), (1, 0), (0, 1), (0, 1), (1, 1), (1, 1)]
    assert owner_of(hm.FINAL_NORM, d8, v) == (1, 1)
    assert owner_of(hm.to_te_name("decoder.layers.5.input_layernorm.weight"), d8, v) == (0, 1)
    assert list(chunk_layer_range(d8, v, 1, 1)) == [6, 7]


def test_gather_flags_and_scratch():
    p1 = _plan(MODELS["qwen2"], (1, 2, None))
    assert not any(p.needs_gather for p in p1.params.values())
    assert p1.gathered_bytes == 0
    assert all(p.scratch_bytes == 0 for p in p1.params.values())
    assert p1.peak_bytes == max(b.nbytes for b in p1.buckets)
    p2 = _plan(MODELS["qwen2"], (2, 1, None))
    for p in p2.params.values():
        assert p.needs_gather == (p.partition != "replicated")
        assert p.gathers_into_bucket == (p.partition == "vocab")
        assert p.scratch_bytes == (p.nbytes if p.needs_gather and p.partition != "vocab" else 0)
        assert p.shard_shape == tuple(
            hm.tp_split(p.name, torch.empty(p.shape, device="meta"), 2, 0, p2.dims).shape
        )
    emb = p2.params[hm.EMBEDDING].slots[0]
    assert emb.reserved == p2.dims.padded_vocab_size * p2.dims.hidden_size > emb.numel


def test_bytes_per_stage_and_rollout_sizing():
    plan = _plan(MODELS["qwen2"], (1, 2, None), rollout_tp=2)
    assert sum(plan.bytes_per_stage()) == plan.total_bytes == plan.hf_bytes
    # embedding on stage 0; lm_head and the final norm on stage 1; 4 layers each
    stage0, stage1 = plan.bytes_per_stage()
    assert stage1 - stage0 == plan.dims.hidden_size * plan.itemsize
    assert plan.rollout_bytes_per_rank() < plan.hf_bytes
    # one KV head at rollout TP 2: k/v replicated, so each rank keeps more than half
    kv1 = _plan({"family": "llama", "num_key_value_heads": 1}, (1, 1, None), rollout_tp=2)
    d = kv1.dims
    k = "model.layers.0.self_attn.k_proj.weight"
    from megarl.rollout.reshard.plan import rollout_shard_shape

    assert rollout_shard_shape(k, hm.hf_param_shape(k, d), d, 2) == (d.head_dim, d.hidden_size)
    assert "replicates KV heads" in kv1.summary()


@pytest.mark.parametrize(
    "dims_kw,layout,rollout_tp,match",
    [
        ({}, (1, 1, None), 3, "does not divide num_attention_heads"),
        ({"num_key_value_heads": 4, "num_attention_heads": 8}, (1, 1, None), 8, None),
        ({}, (1, 3, None), 1, "not divisible by PP"),
        ({}, (1, 2, 4), 1, "not divisible by PP"),
        ({}, (3, 1, None), 1, "training TP=3"),
        ({}, (1, 1, 2), 1, "needs PP > 1"),
    ],
)
def test_layout_errors(dims_kw, layout, rollout_tp, match):
    if match is None:
        _plan(dims_kw, layout, rollout_tp=rollout_tp)  # TP_v a multiple of KV heads: fine
        return
    with pytest.raises(ValueError, match=match):
        _plan(dims_kw, layout, rollout_tp=rollout_tp)


class _NoTensors(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_72b_plan_allocates_nothing():
    """Qwen2.5-72B (80 layers) at TP 8, PP 4 -> vLLM TP 8, bf16 (pure arithmetic: no tensor op,
    so its cost does not grow with the model; no wall-clock assertion)."""
    dims = qwen72b_dims()
    with _NoTensors() as mode:
        plan = make_reshard_plan(dims, ParallelLayout(8, 4), 8)
    assert mode.ops == []
    h, f, d, v, L = 8192, 29568, 128, 152064, 80
    per_layer = (64 + 16) * d * h + (64 + 16) * d + 64 * d * h + 3 * f * h + 2 * h
    assert plan.hf_bytes == 2 * (2 * v * h + L * per_layer + h)  # 72.7B parameters
    assert plan.bytes_per_stage()[1] == plan.bytes_per_stage()[2] == 20 * per_layer * 2
    # bound: the padded embedding (gathered in place), not the model
    emb = 152576 * h * 2
    assert plan.peak_bytes == emb
    assert plan.peak_bytes < plan.total_bytes / 50


def test_plan_cli(capsys):
    assert (
        plan_cli.main(
            ["reshard", "--preset", "qwen2.5-72b", "--tp", "8", "--pp", "4", "--rollout-tp", "8"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "training TP=8 PP=4 VPP=1 -> vLLM TP=8" in out
    assert "buckets: " in out and "MiB per stage: PP0" in out and "TP all-gather" in out
    assert plan_cli.main(["reshard", "--config", "configs/ppo_qwen2_5_72b.yaml", "--buckets"]) == 0
    out = capsys.readouterr().out
    assert "preset qwen2.5-72b" in out and "bucket    0  PP0" in out
    assert plan_cli.main(["reshard", "--preset", "qwen2.5-7b", "--rollout-tp", "8"]) == 2
    assert "does not divide num_attention_heads=28" in capsys.readouterr().err


def test_plan_cli_tiny_model_dir(tmp_path, capsys):
    import json

    cfg = tiny_hf_config("qwen2", tie_word_embeddings=True)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert (
        plan_cli.main(
            ["reshard", "--model", str(tmp_path), "--tp", "2", "--pp", "2", "--dtype", "fp32"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "tied=True" in out and "skipped: output_layer.weight" in out and "float32" in out
