"""HF <-> Megatron layout mapping: pure tensor tests (no processes, no transformers import)."""

from __future__ import annotations

import pytest
import torch

from megarl.models import hf_mapping as hm
from megarl.models.tiny import random_hf_state, tiny_hf_config

FAMILIES = [
    pytest.param("qwen2", False, id="qwen2"),
    pytest.param("qwen2", True, id="qwen2-tied"),
    pytest.param("llama", False, id="llama"),
    pytest.param("llama", True, id="llama-tied"),
    pytest.param("qwen3", False, id="qwen3"),
]


def _dims(family: str, tied: bool = False, **kw) -> hm.ModelDims:
    cfg = tiny_hf_config(family, num_layers=2, tie_word_embeddings=tied, **kw)
    return hm.ModelDims.from_hf_config(cfg)


# ---------------------------------------------------------------- dims / config


def test_dims_from_config() -> None:
    d = _dims("qwen2")
    assert (d.hidden_size, d.ffn_hidden_size, d.num_layers) == (128, 256, 2)
    assert (d.num_attention_heads, d.num_query_groups, d.head_dim) == (4, 2, 32)
    assert d.qkv_bias and not d.qk_norm and not d.tie_word_embeddings
    assert (d.vocab_size, d.padded_vocab_size) == (1000, 1024)
    assert d.architecture == "Qwen2ForCausalLM" and d.rope_theta == 10000.0
    assert not _dims("llama").qkv_bias
    q3 = _dims("qwen3")
    assert q3.qk_norm and not q3.qkv_bias


@pytest.mark.parametrize(
    ("vocab", "tp", "div", "expected"),
    [(1000, 1, 128, 1024), (1000, 2, 128, 1024), (1000, 8, 128, 1024), (1025, 1, 128, 1152),
     (1025, 4, 128, 1536), (1024, 1, 128, 1024), (151646, 8, 128, 152576), (7, 3, 1, 9)],
)  # fmt: skip
def test_padded_vocab(vocab: int, tp: int, div: int, expected: int) -> None:
    assert hm.padded_vocab_size(vocab, tp, div) == expected
    cfg = tiny_hf_config("llama", vocab_size=vocab) | {"vocab_size": vocab}
    dims = hm.ModelDims.from_hf_config(cfg, tp_size=tp, make_vocab_size_divisible_by=div)
    assert dims.padded_vocab_size == expected


def test_dims_from_pretrained_config_object() -> None:
    """Attribute access works like dict access (a ``PretrainedConfig`` stand-in)."""

    class Cfg:
        def __init__(self, d: dict) -> None:
            self.__dict__.update(d)

    cfg = tiny_hf_config("qwen3")
    assert hm.ModelDims.from_hf_config(Cfg(cfg)) == hm.ModelDims.from_hf_config(cfg)


def test_rope_parameters_only() -> None:
    """transformers 5 configs may carry rope_theta only inside ``rope_parameters``."""
    cfg = tiny_hf_config("llama")
    del cfg["rope_theta"]
    cfg["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}
    d = hm.ModelDims.from_hf_config(cfg)
    assert d.rope_theta == 5e5
    assert dict(d.rope_scaling) == {"rope_type": "llama3", "factor": 8.0}


@pytest.mark.parametrize(
    "arch",
    ["GPT2LMHeadModel", "Qwen3NextForCausalLM", "DeepseekV3ForCausalLM", "Gemma2ForCausalLM"],
)
def test_unsupported_architecture_named(arch: str) -> None:
    cfg = tiny_hf_config("llama") | {"architectures": [arch]}
    with pytest.raises(hm.UnsupportedArchitectureError, match=arch):
        hm.ModelDims.from_hf_config(cfg)
    assert issubclass(hm.UnsupportedArchitectureError, ValueError)


def test_unsupported_variants() -> None:
    with pytest.raises(hm.UnsupportedArchitectureError, match="sliding_window"):
        hm.ModelDims.from_hf_config(
            tiny_hf_config("qwen2") | {"use_sliding_window": True, "sliding_window": 64}
        )
    with pytest.raises(hm.UnsupportedArchitectureError, match="mlp_bias"):
        hm.ModelDims.from_hf_config(tiny_hf_config("llama") | {"mlp_bias": True})
    mistral = tiny_hf_config("llama") | {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
    }
    assert hm.ModelDims.from_hf_config(mistral | {"sliding_window": None}).architecture == (
        "MistralForCausalLM"
    )
    with pytest.raises(hm.UnsupportedArchitectureError, match="sliding_window"):
        hm.ModelDims.from_hf_config(mistral | {"sliding_window": 4096})


# ---------------------------------------------------------------- full-model round trip


@pytest.mark.parametrize(("family", "tied"), FAMILIES)
def test_round_trip_bit_identical(family: str, tied: bool) -> None:
    dims = _dims(family, tied)
    hf = random_hf_state(dims, seed=1)
    mg = hm.hf_to_megatron(hf, dims)
    assert list(mg) == hm.megatron_param_names(dims)
    for name, t in mg.items():
        assert tuple(t.shape) == hm.megatron_param_shape(name, dims), name
    assert ("output_layer.weight" in mg) == (not tied)
    assert any(".linear_qkv.bias" in k for k in mg) == (family == "qwen2")
    assert any(".q_layernorm." in k for k in mg) == (family == "qwen3")
    back = hm.megatron_to_hf(mg, dims)
    assert set(back) == set(hf)
    for k, v in hf.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


def test_round_trip_bf16() -> None:
    dims = _dims("qwen2")
    hf = random_hf_state(dims, seed=2, dtype=torch.bfloat16)
    mg = hm.hf_to_megatron(hf, dims)
    assert all(t.dtype == torch.bfloat16 for t in mg.values())
    back = hm.megatron_to_hf(mg, dims)
    assert all(torch.equal(back[k], v) for k, v in hf.items())


def test_vocab_padding_zero_and_trimmed() -> None:
    dims = _dims("llama")
    hf = random_hf_state(dims)
    mg = hm.hf_to_megatron(hf, dims)
    for name, src in [("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
                      ("output_layer.weight", "lm_head.weight")]:  # fmt: skip
        t = mg[name]
        assert t.shape == (1024, 128)
        assert torch.equal(t[:1000], hf[src])
        assert torch.count_nonzero(t[1000:]) == 0
        trimmed = hm.megatron_param_to_hf(name, t, dims)[src]
        assert trimmed.shape == (1000, 128)


def test_tied_output_layer_for_last_pp_stage() -> None:
    dims = _dims("qwen2", tied=True)
    hf = random_hf_state(dims)
    hf_with_head = hf | {"lm_head.weight": hf["model.embed_tokens.weight"]}
    assert "output_layer.weight" not in hm.hf_to_megatron(hf_with_head, dims)
    names = hm.megatron_param_names(dims, include_tied_output=True)
    assert names[-1] == "output_layer.weight"
    assert hm.megatron_param_sources("output_layer.weight", dims) == ["model.embed_tokens.weight"]
    out = hm.hf_to_megatron_param("output_layer.weight", hf.__getitem__, dims)
    emb = hm.build_megatron_param("embedding.word_embeddings.weight", hf, dims)
    assert torch.equal(out, emb)
    assert hm.megatron_param_to_hf("output_layer.weight", out, dims) == {}
    # megatron_to_hf ignores the tied copy
    mg = hm.hf_to_megatron(hf, dims) | {"output_layer.weight": out}
    assert "lm_head.weight" not in hm.megatron_to_hf(mg, dims)


def test_unmapped_hf_tensor_is_an_error() -> None:
    dims = _dims("llama")
    hf = random_hf_state(dims) | {"model.layers.0.self_attn.q_proj.bias": torch.zeros(128)}
    with pytest.raises(ValueError, match="q_proj.bias"):
        hm.hf_to_megatron(hf, dims)
    hf = random_hf_state(dims) | {"model.rotary_emb.inv_freq": torch.zeros(16)}
    hm.hf_to_megatron(hf, dims)  # rotary buffers are fine


def test_missing_megatron_param_is_an_error() -> None:
    dims = _dims("llama")
    mg = hm.hf_to_megatron(random_hf_state(dims), dims)
    del mg["decoder.layers.1.mlp.linear_fc2.weight"]
    with pytest.raises(ValueError, match="down_proj"):
        hm.megatron_to_hf(mg, dims)


def test_shape_mismatch_is_an_error() -> None:
    dims = _dims("qwen2")
    hf = random_hf_state(dims)
    hf["model.embed_tokens.weight"] = hf["model.embed_tokens.weight"][:999]
    with pytest.raises(ValueError, match="vocab_size"):
        hm.hf_to_megatron(hf, dims)
    other = _dims("qwen2", head_dim=16)
    with pytest.raises(ValueError, match="linear_qkv"):
        hm.hf_to_megatron(random_hf_state(_dims("qwen2")), other)


def test_lazy_per_param_conversion_matches_whole_model() -> None:
    dims = _dims("qwen3")
    hf = random_hf_state(dims)
    full = hm.hf_to_megatron(hf, dims)
    read: list[str] = []

    def getter(name: str) -> torch.Tensor:
        read.append(name)
        return hf[name]

    for name in hm.megatron_param_names(dims):
        read.clear()
        t = hm.hf_to_megatron_param(name, getter, dims)
        assert read == hm.megatron_param_sources(name, dims)
        assert torch.equal(t, full[name])
        out = hm.megatron_to_hf_param(name, t, dims)
        assert list(out) == hm.megatron_param_sources(name, dims)
        assert all(torch.equal(v, hf[k]) for k, v in out.items())


# ---------------------------------------------------------------- fused layouts


def _labelled_qkv(dims: hm.ModelDims) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HF q/k/v whose every row holds code = kind*10000 + head*100 + row (kind q=1, k=2, v=3)."""

    def make(kind: int, heads: int) -> torch.Tensor:
        codes = [kind * 10000 + h * 100 + r for h in range(heads) for r in range(dims.head_dim)]
        return (
            torch.tensor(codes, dtype=torch.float64)[:, None]
            .expand(-1, dims.hidden_size)
            .contiguous()
        )

    return (make(1, dims.num_attention_heads), make(2, dims.num_query_groups),
            make(3, dims.num_query_groups))  # fmt: skip


def _expected_interleave(dims: hm.ModelDims, groups: range) -> list[int]:
    d, per = dims.head_dim, dims.heads_per_group
    rows: list[int] = []
    for g in groups:
        for h in range(g * per, (g + 1) * per):
            rows += [10000 + h * 100 + r for r in range(d)]
        rows += [20000 + g * 100 + r for r in range(d)]
        rows += [30000 + g * 100 + r for r in range(d)]
    return rows


@pytest.mark.parametrize(("heads", "groups"), [(4, 2), (8, 2), (4, 4), (4, 1), (8, 8)])
def test_qkv_interleave_layout_and_tp_groups(heads: int, groups: int) -> None:
    dims = _dims("qwen2", num_attention_heads=heads, num_key_value_heads=groups)
    q, k, v = _labelled_qkv(dims)
    hf = {"model.layers.0.self_attn.q_proj.weight": q, "model.layers.0.self_attn.k_proj.weight": k,
          "model.layers.0.self_attn.v_proj.weight": v}  # fmt: skip
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    qkv = hm.build_megatron_param(name, hf, dims)
    assert qkv[:, 0].long().tolist() == _expected_interleave(dims, range(groups))
    for tp in (1, 2, 4):
        if groups % tp:
            # TP a multiple of the groups (Megatron-Core >= 0.16): plain even dim-0 chunks
            rows = qkv.shape[0] // tp
            for r in range(tp):
                assert torch.equal(
                    hm.tp_split(name, qkv, tp, r, dims), qkv[r * rows : (r + 1) * rows]
                )
            continue
        per_rank = groups // tp
        for r in range(tp):
            shard = hm.tp_split(name, qkv, tp, r, dims)
            owned = range(r * per_rank, (r + 1) * per_rank)
            assert shard[:, 0].long().tolist() == _expected_interleave(dims, owned)
            # a shard splits into the rank's own q heads / kv heads
            sq, sk, sv = hm.qkv_megatron_to_separate(shard, dims)
            hq = heads // tp
            assert torch.equal(sq, q[r * hq * dims.head_dim : (r + 1) * hq * dims.head_dim])
            kv_rows = slice(owned.start * dims.head_dim, owned.stop * dims.head_dim)
            assert torch.equal(sk, k[kv_rows]) and torch.equal(sv, v[kv_rows])
            assert torch.equal(hm.qkv_separate_to_megatron(sq, sk, sv, dims), shard)


def test_qkv_bias_layout() -> None:
    dims = _dims("qwen2")
    q, k, v = (t[:, 0].contiguous() for t in _labelled_qkv(dims))
    qkv = hm.qkv_separate_to_megatron(q, k, v, dims)
    assert qkv.shape == (dims.qkv_rows,)
    assert qkv.long().tolist() == _expected_interleave(dims, range(dims.num_query_groups))
    assert all(torch.equal(a, b) for a, b in zip(hm.qkv_megatron_to_separate(qkv, dims), (q, k, v)))


def test_fc1_shard_is_gate_chunk_then_up_chunk() -> None:
    dims = _dims("llama")
    f = dims.ffn_hidden_size
    gate = torch.arange(f, dtype=torch.float32)[:, None].expand(-1, 128).contiguous()
    up = gate + 100000
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    fc1 = hm.build_megatron_param(
        name, {"model.layers.0.mlp.gate_proj.weight": gate, "model.layers.0.mlp.up_proj.weight": up},
        dims,
    )  # fmt: skip
    assert torch.equal(fc1, torch.cat([gate, up]))
    for tp in (2, 4):
        c = f // tp
        for r in range(tp):
            shard = hm.tp_split(name, fc1, tp, r, dims)
            assert torch.equal(
                shard, torch.cat([gate[r * c : (r + 1) * c], up[r * c : (r + 1) * c]])
            )
            g, u = hm.fc1_to_gate_up(shard)
            assert torch.equal(g, gate[r * c : (r + 1) * c]) and torch.equal(
                u, up[r * c : (r + 1) * c]
            )


# ---------------------------------------------------------------- tensor parallelism


def test_partition_kinds() -> None:
    kinds = {
        "embedding.word_embeddings.weight": "vocab",
        "output_layer.weight": "vocab",
        "decoder.final_layernorm.weight": "replicated",
        "decoder.layers.3.input_layernorm.weight": "replicated",
        "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight": "replicated",
        "decoder.layers.3.self_attention.linear_qkv.weight": "column",
        "decoder.layers.3.self_attention.linear_qkv.bias": "column",
        "decoder.layers.3.self_attention.q_layernorm.weight": "replicated",
        "decoder.layers.3.self_attention.k_layernorm.weight": "replicated",
        "decoder.layers.3.self_attention.linear_proj.weight": "row",
        "decoder.layers.3.pre_mlp_layernorm.weight": "replicated",
        "decoder.layers.3.mlp.linear_fc1.layer_norm_weight": "replicated",
        "decoder.layers.3.mlp.linear_fc1.weight": "fc1",
        "decoder.layers.3.mlp.linear_fc2.weight": "row",
    }
    assert {n: hm.tp_partition_kind(n) for n in kinds} == kinds
    with pytest.raises(KeyError, match="nonsense"):
        hm.tp_partition_kind("decoder.layers.0.nonsense.weight")


@pytest.mark.parametrize(("family", "tied"), FAMILIES)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_split_merge_identity(family: str, tied: bool, tp: int) -> None:
    dims = hm.ModelDims.from_hf_config(
        tiny_hf_config(family, num_layers=1, tie_word_embeddings=tied, num_key_value_heads=4),
        tp_size=tp,
    )
    mg = hm.hf_to_megatron(random_hf_state(dims), dims)
    for name, full in mg.items():
        shards = [hm.tp_split(name, full, tp, r, dims) for r in range(tp)]
        kind = hm.tp_partition_kind(name)
        if kind == "replicated":
            assert all(s.shape == full.shape for s in shards)
        elif kind == "row":
            assert all(s.shape == (full.shape[0], full.shape[1] // tp) for s in shards)
        else:
            assert all(s.shape == (full.shape[0] // tp, *full.shape[1:]) for s in shards)
        assert hm.tp_shard_shape(name, tuple(full.shape), tp) == tuple(shards[0].shape), name
        assert torch.equal(hm.tp_merge(name, shards, dims), full), name


def test_row_parallel_and_vocab_shards() -> None:
    dims = _dims("llama")
    x = torch.arange(128 * 128, dtype=torch.float32).reshape(128, 128)
    s = hm.tp_split("decoder.layers.0.self_attention.linear_proj.weight", x, 4, 1, dims)
    assert torch.equal(s, x[:, 32:64])
    emb = torch.arange(1024, dtype=torch.float32)[:, None].expand(-1, 4)
    s = hm.tp_split("embedding.word_embeddings.weight", emb, 2, 1, dims)
    assert s[0, 0] == 512 and s.shape[0] == 512
    with pytest.raises(ValueError, match="tp_rank"):
        hm.tp_split("embedding.word_embeddings.weight", emb, 2, 2, dims)
    bad = _dims("llama", num_attention_heads=6, num_key_value_heads=3, head_dim=32)
    qkv = torch.zeros(bad.qkv_rows, 128)
    with pytest.raises(ValueError, match="multiple or divisor"):
        hm.tp_split("decoder.layers.0.self_attention.linear_qkv.weight", qkv, 2, 0, bad)


# ---------------------------------------------------------------- names


def test_layer_offset_rewrite() -> None:
    n = "decoder.layers.2.self_attention.linear_qkv.weight"
    assert hm.megatron_name_to_global(n, 6) == "decoder.layers.8.self_attention.linear_qkv.weight"
    assert hm.megatron_name_to_local("decoder.layers.8.mlp.linear_fc2.weight", 6) == (
        "decoder.layers.2.mlp.linear_fc2.weight"
    )
    assert hm.megatron_name_to_global("embedding.word_embeddings.weight", 6) == (
        "embedding.word_embeddings.weight"
    )
    assert hm.layer_index("decoder.layers.12.input_layernorm.weight") == 12
    assert hm.layer_index("decoder.final_layernorm.weight") is None
    with pytest.raises(ValueError):
        hm.megatron_name_to_local("decoder.layers.1.input_layernorm.weight", 2)
    # VPP: chunk-local names with per-chunk offsets map to distinct global layers
    chunks = {0: 0, 1: 4}  # e.g. PP=2, VPP=2, 8 layers, rank 0 holds layers 0-1 and 4-5
    glob = {hm.megatron_name_to_global(f"decoder.layers.{i}.pre_mlp_layernorm.weight", off)
            for off in chunks.values() for i in range(2)}  # fmt: skip
    assert {hm.layer_index(g) for g in glob} == {0, 1, 4, 5}


@pytest.mark.parametrize(("family", "tied"), FAMILIES)
def test_te_names_round_trip(family: str, tied: bool) -> None:
    dims = _dims(family, tied)
    mg = hm.hf_to_megatron(random_hf_state(dims), dims)
    te = hm.to_te_names(mg)
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in te
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in te
    assert not any("input_layernorm" in k or "pre_mlp_layernorm" in k for k in te)
    assert "decoder.final_layernorm.weight" in te
    te_with_extra = te | {"decoder.layers.0.self_attention.linear_qkv._extra_state": None}
    assert hm.from_te_names(te_with_extra).keys() == mg.keys()
    # mapping functions accept TE names directly
    hf = hm.megatron_to_hf(te_with_extra, dims)
    assert torch.equal(hf["model.layers.0.input_layernorm.weight"],
                       mg["decoder.layers.0.input_layernorm.weight"])  # fmt: skip
    assert hm.megatron_param_sources("decoder.layers.1.mlp.linear_fc1.layer_norm_weight", dims) == [
        "model.layers.1.post_attention_layernorm.weight"
    ]


def test_hf_names_and_shapes() -> None:
    dims = _dims("qwen3", tied=True)
    names = hm.hf_param_names(dims)
    assert "lm_head.weight" not in names
    assert "model.layers.1.self_attn.q_norm.weight" in names
    assert hm.hf_param_shape("model.layers.1.self_attn.k_proj.weight", dims) == (64, 128)
    assert len(names) == len(set(names)) == 2 + 2 * 11
