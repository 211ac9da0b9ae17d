"""Shapes of common models (their HF ``config.json`` fields), and the one way the planner finds a
config's model shape: ``--model``/``--preset``, else the ``config.json`` at the model path, else a
preset whose name the path contains, else a complete ``*.model.architecture`` section.
"""

from __future__ import annotations

from pathlib import Path

from megarl.config.model_dims import ModelDims, read_hf_config
from megarl.config.model_source import architecture_dims, find_config_json, is_remote
from megarl.config.schema import ModelConfig

_QWEN25 = {
    "architectures": ["Qwen2ForCausalLM"],
    "vocab_size": 152064,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
}
# Qwen3-MoE: the fields of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B's config.json on the
# Hugging Face Hub (April 2025 release), checked on 2026-11-26 against public copies: Ascend
# MindSpeed-RL configs/model/qwen3_235b_a22b.yaml (94 layers, 128 experts, top-8,
# moe_ffn_hidden_size 1536, hidden 4096, ffn 12288, 64 heads, 4 query groups, kv_channels 128,
# vocab 151936, rotary base 1e6, max positions 40960, untied, norm_topk_prob), a published copy
# of the 30B-A3B config.json with layers and experts reduced for profiling (hidden 2048,
# intermediate 6144, 32 heads, 4 KV heads, moe_intermediate_size 768, top-8, vocab 151936,
# max positions 40960, rope_theta 1e6, rms_norm_eps 1e-6, untied, norm_topk_prob), and the
# model card totals (30.5B total / 3.3B activated; 235B / 22B), which the hand counts in
# tests/planner/test_memory_moe.py reproduce from these shapes.
_QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "head_dim": 128,
    "num_key_value_heads": 4,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "tie_word_embeddings": False,
    "attention_bias": False,
    "hidden_act": "silu",
}
PRESETS: dict[str, dict] = {
    "qwen2.5-7b": {
        **_QWEN25,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
    },
    "qwen2.5-32b": {
        **_QWEN25,
        "hidden_size": 5120,
        "intermediate_size": 27648,
        "num_hidden_layers": 64,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
    },
    "qwen2.5-72b": {
        **_QWEN25,
        "hidden_size": 8192,
        "intermediate_size": 29568,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
    },
    "qwen3-30b-a3b": {
        **_QWEN3_MOE,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
    },
    "qwen3-235b-a22b": {
        **_QWEN3_MOE,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "moe_intermediate_size": 1536,
        "num_hidden_layers": 94,
        "num_attention_heads": 64,
    },
}
"""HF ``config.json`` shapes of common models, for planning without the model files."""


def preset_config(name: str) -> dict:
    """The preset's HF config; ``ValueError`` naming the known presets."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]


def hf_config_at(path: str) -> tuple[dict, str]:
    """The HF config of a model directory or ``config.json`` file, and its path.

    ``FileNotFoundError`` / ``ValueError`` name the path.
    """
    p = Path(path).expanduser()
    config_json = p / "config.json" if p.is_dir() else p
    return read_hf_config(config_json), str(config_json)


def resolve_hf_config(model: ModelConfig, *, preset: str | None = None) -> tuple[dict, str]:
    """The HF config of ``model`` and where it came from (see the module docstring).

    Raises ``ValueError`` naming the path and the ways to give the shape when none applies.
    """
    if preset:
        return preset_config(preset), f"preset {preset}"
    path = model.path or ""
    found = None if not path or is_remote(path) else find_config_json(path)
    if found is not None and found.is_file():
        hf = dict(read_hf_config(found))
        hf.update(model.override_config)
        return hf, str(found)
    key = path.lower().replace("_", ".")
    for name in sorted(PRESETS, key=len, reverse=True):
        if name in key:
            return PRESETS[name], f"preset {name} (matched {path!r})"
    declared = architecture_dims(model.architecture)
    needed = ("hidden_size", "ffn_hidden_size", "num_layers", "num_attention_heads", "vocab_size")
    if all(k in declared for k in needed):
        arch = model.architecture
        hf = {k: v for k, v in arch.__dict__.items() if v is not None}
        hf["architectures"] = [hf.pop("architecture", "LlamaForCausalLM")]
        return hf, "the model's architecture section"
    raise ValueError(
        f"no config.json for model path {path!r} and no preset matches it; pass --model DIR or "
        f"--preset ({', '.join(sorted(PRESETS))}), or complete its architecture section"
    )


def resolve_dims(
    model: ModelConfig, tp: int, *, preset: str | None = None
) -> tuple[ModelDims, str]:
    """:class:`ModelDims` of ``model`` (vocabulary padded for ``tp``) and its source."""
    hf, source = resolve_hf_config(model, preset=preset)
    return ModelDims.from_hf_config(hf, tp_size=tp), source
