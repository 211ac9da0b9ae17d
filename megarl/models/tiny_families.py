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

VL_ARCHITECTURES = {
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
}
"""The tiny vision-language families (:mod:`megarl.models.tiny_vl`, issue 58): a Qwen2 language
model and Qwen's vision tower. Apart from :data:`ARCHITECTURES`: the text-only commands that
list the families (the quickstart) cannot train them yet."""
