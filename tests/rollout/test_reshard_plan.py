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
from megarl.rollout.reshard.make_plan import make_reshard_plan
from megarl.rollout.reshard.plan import chunk_layer_range, owner_of

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


# --------------------------------------------------------------------------------------------
# Slices: what each vLLM TP rank receives from other stages
# --------------------------------------------------------------------------------------------


def _expected_slice_numel(name: str, shape: tuple[int, ...], dims, t: int, r: int) -> int:
    """Elements of HF tensor ``name`` that vLLM TP rank ``r`` of ``t`` loads, by hand from the
    model's shapes (independent of ``rollout_slice``): norms whole, k/v one KV-head share (a
    whole head when t > KV heads), vocab rows of the 64-padded split, everything else 1/t."""
    numel = 1
    for n in shape:
        numel *= n
    leaf = name.split(".")[-2]
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        per = -(-shape[0] // 64) * 64 // t
        rows = max(0, min((r + 1) * per, shape[0]) - min(r * per, shape[0]))
        return rows * shape[1]
    if leaf.endswith("norm"):
        return numel
    if leaf in ("k_proj", "v_proj"):
        return numel * max(dims.num_query_groups // t, 1) // dims.num_query_groups
    return numel // t


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("layout", [(1, 2, None), (2, 2, None), (2, 2, 2), (1, 4, None)])
@pytest.mark.parametrize("rollout_tp", [1, 2, 4])
def test_received_bytes_are_the_rollout_slices_of_other_stages(model, layout, rollout_tp):
    """Per (stage, vLLM TP rank): bytes received from other stages = that rank's slice of
    every HF tensor they own (counted by hand), about 1/rollout_TP of them (norms whole, KV
    heads replicated); the TP all-gather part = the other shards of the stage's split params."""
    kw = {**MODELS[model], "num_key_value_heads": 1 if model == "qwen3" else 2}
    plan = _plan(kw, layout, rollout_tp=rollout_tp)
    dims, t, tp = plan.dims, rollout_tp, layout[0]
    for stage in range(layout[1]):
        other = [s for b in plan.buckets if b.pp_rank != stage for s in b.slots]
        other_bytes = sum(s.numel for s in other) * plan.itemsize
        gathered = sum(
            p.nbytes for b in plan.buckets if b.pp_rank == stage for p in b.params if p.needs_gather
        )
        for r in range(t):
            want = sum(_expected_slice_numel(s.name, s.shape, dims, t, r) for s in other)
            got = plan.received(stage, r)
            assert got.pipeline == want * plan.itemsize, (stage, r)
            assert got.tp_gather == gathered * (tp - 1) // tp
            assert got.total == got.pipeline + got.tp_gather
            # ~1/t: within the norms and the uneven vocab split (+ KV heads replicated past
            # their count: k/v are large next to q in these tiny models)
            slack = 1.1 if t <= dims.num_query_groups else 1.25
            assert other_bytes / t * 0.9 <= got.pipeline <= other_bytes / t * slack + 1
        assert plan.full_bytes_from_other_stages(stage) >= other_bytes
    for r in range(t):
        total = sum(
            _expected_slice_numel(s.name, s.shape, dims, t, r)
            for b in plan.buckets
            for s in b.slots
        )
        assert plan.rollout_slice_bytes(r) == total * plan.itemsize


def test_slices_by_hand():
    """vLLM's narrowing on named cases: vocab padded to 64 then split (a shard of padding
    only gets nothing), KV heads replicated past their count, row-parallel by columns."""
    from megarl.rollout.reshard.plan import rollout_slice

    d = tiny_dims(num_key_value_heads=2, vocab_size=65)  # vLLM pads 65 -> 128 rows
    emb, v = "model.embed_tokens.weight", (65, 128)
    assert [rollout_slice(emb, v, d, 4, r) for r in range(4)] == [
        (0, 0, 32),
        (0, 32, 64),
        (0, 64, 65),
        (0, 65, 65),
    ]
    assert rollout_slice(emb, v, d, 1, 0) == (0, 0, 65)
    k = "model.layers.0.self_attn.k_proj.weight"
    assert [rollout_slice(k, (64, 128), d, 4, r) for r in range(4)] == [
        (0, 0, 32),
        (0, 0, 32),
        (0, 32, 64),
        (0, 32, 64),
    ]
    assert rollout_slice(k, (64, 128), d, 2, 1) == (0, 32, 64)
    assert rollout_slice("model.layers.0.self_attn.v_proj.bias", (64,), d, 4, 3) == (0, 32, 64)
    assert rollout_slice("model.layers.0.self_attn.q_proj.bias", (128,), d, 4, 3) == (0, 96, 128)
    assert rollout_slice("model.layers.0.mlp.down_proj.weight", (128, 256), d, 2, 1) == (
        1,
        128,
        256,
    )
    assert rollout_slice("model.layers.0.mlp.up_proj.weight", (256, 128), d, 2, 1) == (0, 128, 256)
    assert rollout_slice("model.layers.0.self_attn.q_norm.weight", (32,), d, 4, 2) is None
    assert rollout_slice("model.norm.weight", (128,), d, 2, 0) is None
    assert rollout_slice("model.layers.0.mlp.up_proj.weight", (256, 128), d, 1, 0) is None
    with pytest.raises(ValueError, match="outside"):
        rollout_slice(k, (64, 128), d, 2, 2)
    # the plan: the embedding bucket of the last vLLM rank is empty; others are one run
    plan = make_reshard_plan(d, ParallelLayout(1, 2), 4, bucket_bytes=64 << 10)
    (emb_bucket,) = [b for b in plan.buckets if b.slots[0].name == emb]
    assert emb_bucket.message_numel(3) == 0 and emb_bucket.message_range(3) is None
    assert emb_bucket.message_range(2) == (64 * 128, 65 * 128)


def test_message_buffers_and_peak():
    """A message that is one run of the bucket travels in place (no pack buffer: vLLM TP 1,
    vocabulary shards); others are packed, and the plan's peak counts that buffer."""
    one = _plan(MODELS["qwen2"], (1, 2, None), rollout_tp=1)
    assert all(b.pack_numel == 0 for b in one.buckets)
    assert all(b.message_range(0) is not None for b in one.buckets)
    no_pp = _plan(MODELS["qwen2"], (2, 1, None), rollout_tp=2)
    assert all(b.pack_numel == 0 for b in no_pp.buckets)
    assert no_pp.received(0, 1).pipeline == 0
    two = _plan(MODELS["qwen2"], (2, 2, None), rollout_tp=2)
    packed = 0
    for b in two.buckets:
        runs = [b.message_range(v) for v in range(2)]
        if any(p.partition == "vocab" for p in b.params):
            assert None not in runs  # a vocabulary shard is a run of rows
        if None in runs:
            packed += 1
            assert b.pack_numel == max(b.message_numel(v) for v in range(2)) < b.numel
        else:
            assert b.pack_numel == 0
        assert b.peak_bytes == b.nbytes + max(b.scratch_bytes, b.pack_numel * b.itemsize)
    assert packed > len(two.buckets) // 2
    assert two.peak_bytes == max(b.peak_bytes for b in two.buckets)


def test_72b_received_per_rank_and_node():
    """Qwen2.5-72B, TP 8 × PP 4 on 8-GPU nodes (one stage per node), vLLM TP 8: a rank receives
    about 1/8 of the other stages (~13 GiB) instead of all of them (~100 GiB)."""
    plan = make_reshard_plan(qwen72b_dims(), ParallelLayout(8, 4), 8)
    gib = 1 << 30
    for stage in range(4):
        full = plan.full_bytes_from_other_stages(stage)
        per_rank = [plan.received(stage, r).pipeline for r in range(8)]
        assert max(per_rank) < full / 8 * 1.002 and min(per_rank) > full / 8 * 0.99
        node = sum(per_rank)
        assert 95 * gib < node < 110 * gib and 750 * gib < 8 * full < 850 * gib
    assert abs(plan.rollout_slice_bytes(0) / plan.hf_bytes - 1 / 8) < 0.001


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
    assert "received per rank and sync, MiB:" in out
    assert "  PP1: 13151.0 from other stages (unsliced 105211.1) + 29295.3 in the TP" in out
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


# --------------------------------------------------------------------------------------------
# Mixture-of-Experts
# --------------------------------------------------------------------------------------------

MOE_LAYOUTS = [  # (TP, PP, EP, ETP)
    (1, 1, 2, 1),
    (2, 1, 2, 1),
    (2, 1, 2, 2),
    (1, 2, 2, 1),
    (1, 1, 4, 1),
    (2, 2, 1, 2),
]


def _moe_plan(family: str, layout: tuple, rollout_tp: int = 1, bucket_bytes: int = 64 << 10):
    tp, pp, ep, etp = layout
    dims = tiny_dims(family, tp=tp)
    lay = ParallelLayout(tp, pp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    return make_reshard_plan(dims, lay, rollout_tp, bucket_bytes=bucket_bytes)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
@pytest.mark.parametrize("layout", MOE_LAYOUTS)
def test_moe_experts_by_ep_rank_whole_layer_in_one_bucket(family, layout):
    """Every expert once, held by EP rank e // (E/EP) and split over expert TP; a layer's
    experts form one bucket (vLLM's FusedMoE processes them together) whose EP runs cover
    exactly the experts, one run per EP rank in rank order; router and shared expert follow the
    dense rules. Bytes received: the other EP ranks' experts, whole."""
    tp, _, ep, etp = layout
    plan = _moe_plan(family, layout)
    dims = plan.dims
    assert [p.name for b in plan.buckets for p in b.params] == hm.megatron_param_names(dims)
    per_rank = dims.num_experts // ep
    for b in plan.buckets:
        experts = [p for p in b.params if p.ep_rank is not None]
        for p in b.params:
            found = hm.layer_index(p.name), p.name.split(".mlp.")[-1]
            if ".local_experts." not in p.name:
                assert p.ep_rank is None and p.needs_gather == (
                    tp > 1 and p.partition != "replicated"
                ), found
                continue
            e = int(p.name.split(".local_experts.")[1].split(".")[0])
            assert p.ep_rank == e // per_rank, found
            assert p.needs_gather == (etp > 1)
            assert p.shard_shape == hm.tp_shard_shape(p.name, p.shape, etp)
        if experts:
            layers = {hm.layer_index(p.name) for p in experts}
            assert len(layers) == 1 and len(experts) == 2 * dims.num_experts  # the whole layer
            if ep == 1:
                assert b.expert_runs == ()
                continue
            assert [k for k, *_ in b.expert_runs] == list(range(ep))
            start = min(s.offset for p in experts for s in p.slots)
            assert b.expert_runs[0][1] == start
            assert all(r[2] == n[1] for r, n in zip(b.expert_runs, b.expert_runs[1:]))
            assert sum(stop - lo for _, lo, stop in b.expert_runs) == sum(
                s.numel for p in experts for s in p.slots
            )
    expert_bytes = sum(
        p.hf_bytes for p in plan.params.values() if p.ep_rank is not None and p.pp_rank == 0
    )
    for k in range(ep):
        got = plan.received(0, 0, k)
        assert got.ep_broadcast == (expert_bytes * (ep - 1) // ep if ep > 1 else 0)
    if ep > 1:
        assert f"EP={ep} ETP={etp}" in plan.summary()
        assert "broadcast in the EP group" in plan.summary()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_moe_rollout_slices_split_each_expert_over_vllm_tp(family):
    """vLLM TP 2: each expert's gate/up (Mixtral w1/w3) by rows, down (w2) by columns, the
    router whole; one rank's slices are ~half the model."""
    plan = _moe_plan(family, (1, 2, 2, 1), rollout_tp=2)
    names = {s.name: s for b in plan.buckets for s in b.slots}
    gate, up, down = (
        ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    )
    prefix = "block_sparse_moe" if family == "mixtral" else "mlp"
    expert = f"model.layers.1.{prefix}.experts.5"
    f, h = plan.dims.moe_ffn_hidden_size, plan.dims.hidden_size
    for v in range(2):
        pieces = {
            p.slot.name: (p.dim, p.start, p.stop)
            for b in plan.buckets
            for p in b.slices[v]
            if p.slot.name.startswith(f"{expert}.") or p.slot.name.endswith(f"{prefix}.gate.weight")
        }
        half = f // 2
        assert pieces[f"{expert}.{gate}.weight"] == (0, v * half, (v + 1) * half)
        assert pieces[f"{expert}.{up}.weight"] == (0, v * half, (v + 1) * half)
        assert pieces[f"{expert}.{down}.weight"] == (1, v * half, (v + 1) * half)
        assert pieces[f"model.layers.1.{prefix}.gate.weight"] == (None, 0, 0)
        assert names[f"{expert}.{down}.weight"].shape == (h, f)
        share = plan.rollout_slice_bytes(v) / plan.hf_bytes
        assert 0.45 < share < 0.6, share


def test_moe_layout_errors():
    dims = tiny_dims("qwen3_moe", num_experts=6)
    with pytest.raises(ValueError, match="EP=4 does not divide the model's 6 experts"):
        make_reshard_plan(dims, ParallelLayout(1, 1, expert_model_parallel_size=4), 1)


def test_plan_cli_moe_model_dir(tmp_path, capsys):
    """``megarl plan reshard --ep/--etp`` on a MoE config.json; an EP the experts do not split
    into is one line, exit 2."""
    import json

    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config("qwen3_moe")))
    args = ["reshard", "--model", str(tmp_path), "--tp", "2", "--ep", "4", "--etp", "1"]
    assert plan_cli.main([*args, "--rollout-tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "training TP=2 PP=1 VPP=1 EP=4 ETP=1 -> vLLM TP=2" in out
    assert "experts: 8 over EP=4, broadcast in the EP group" in out
    assert plan_cli.main([*args[:-4], "--ep", "3"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "error: EP=3 does not divide the model's 8 experts", err
