"""The tiny model families (:mod:`megarl.models.tiny`) and their HF architectures, without
importing torch: the quickstart lists them before it launches anything."""

from __future__ import annotations

ARCHITECTURES = {
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
}
