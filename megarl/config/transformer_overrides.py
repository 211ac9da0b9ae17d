"""``*.megatron.override_transformer_config``: the Megatron ``TransformerConfig`` fields a verl
script sets directly (verl applies them over the config it builds from the HF model).

megarl takes an allow-list, each entry honoured or refused in one line, never dropped silently:

- :data:`MEGARL_KEYS`: megarl's own ``megatron.*`` keys of the same name (recompute, fusions),
  moved there by :mod:`megarl.config.spellings`;
- :data:`PASSED`: passed to ``TransformerConfig`` as given (attention backend, MoE knobs);
- :data:`NO_EFFECT`: accepted, changing no number (why given);
- :data:`DEFAULT_ONLY`: accepted at Megatron's default only (uneven pipeline stages);
- :data:`FROM_HF` and :data:`LAYOUT`: what megarl's HF weight mapping reads (the model's
  shape) or the parallel layout: refused, naming where the value comes from.
"""

from __future__ import annotations

from typing import Any

RECOMPUTE = ("recompute_granularity", "recompute_method", "recompute_num_layers",
             "recompute_modules")  # fmt: skip
FUSIONS = ("apply_rope_fusion", "bias_activation_fusion", "gradient_accumulation_fusion",
           "deallocate_pipeline_outputs")  # fmt: skip
MEGARL_KEYS = (*RECOMPUTE, *FUSIONS)
"""Entries that are megarl's ``megatron.*`` keys (each applied where the layer spec allows it:
:class:`megarl.models.gpt.Fusions`, :class:`megarl.models.build.Recompute`)."""

ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
"""Megatron's ``AttnBackend`` names: Transformer Engine's kernels (auto, flash, fused, unfused) or
Megatron's own attention (local; the only one of the local layer spec that runs on CPU)."""

PASSED: dict[str, str] = {
    "attention_backend": "Transformer Engine's attention kernel (AttnBackend)",
    "moe_*": "Megatron's MoE knobs (megarl.models.gpt.MoeSettings)",
}
"""Entries passed to ``TransformerConfig`` as given."""

NO_EFFECT: dict[str, str] = {
    "use_flash_attn": "the attention kernel follows attention_backend / megatron.transformer_impl",
    "masked_softmax_fusion": "Transformer Engine's attention is fused itself (an apex kernel of "
    "the local spec, which megarl keeps plain)",
    "persist_layer_norm": "Transformer Engine's norms are fused themselves (apex in the local spec)",
    "bias_dropout_fusion": "the families megarl builds have no dropout",
    "cross_entropy_loss_fusion": "megarl computes log-probs vocab-parallel itself, not Megatron's loss",
    "cross_entropy_fusion_impl": "megarl computes log-probs vocab-parallel itself, not Megatron's loss",
}
"""Entries accepted at any value, with no effect in megarl (why)."""

DEFAULT_ONLY: dict[str, tuple[Any, str]] = {
    "num_layers_in_first_pipeline_stage": (None, "uneven pipeline stages"),
    "num_layers_in_last_pipeline_stage": (None, "uneven pipeline stages"),
    "account_for_embedding_in_pipeline_split": (False, "uneven pipeline stages"),
    "account_for_loss_in_pipeline_split": (False, "uneven pipeline stages"),
}
"""Entries accepted only at Megatron's default: (that value, the feature megarl lacks)."""

FROM_HF = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
           "num_query_groups", "kv_channels", "normalization", "layernorm_epsilon",
           "gated_linear_unit", "activation_func", "add_bias_linear", "add_qkv_bias",
           "qk_layernorm", "num_moe_experts", "moe_ffn_hidden_size", "moe_router_topk",
           "moe_shared_expert_intermediate_size", "vocab_size", "params_dtype", "bf16", "fp16",
           "hidden_dropout", "attention_dropout", "multi_latent_attention")  # fmt: skip
"""Fields the model's shape fixes: megarl's HF weight mapping reads them from config.json."""

LAYOUT = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
          "virtual_pipeline_model_parallel_size", "context_parallel_size",
          "expert_model_parallel_size", "expert_tensor_parallel_size", "sequence_parallel")  # fmt: skip
"""Fields of the parallel layout: ``megatron.<key>``."""


def _show(value: Any) -> str:
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else str(value)


def transformer_override_problems(prefix: str, overrides: dict[str, Any]) -> list[str]:
    """One line per entry of ``overrides`` (``prefix``: ``<role>.megatron``; the
    :data:`MEGARL_KEYS` already moved out) that megarl cannot apply, each naming what works."""
    key = f"{prefix}.override_transformer_config"
    problems = []
    for name, value in overrides.items():
        entry = f"{key}.{name}={_show(value)}"
        if name in NO_EFFECT or name.startswith("moe_") and name not in FROM_HF:
            continue  # moe_*: checked with the model (megarl.models.gpt.MoeSettings)
        if name == "attention_backend":
            if str(value).removeprefix("AttnBackend.") not in ATTENTION_BACKENDS:
                problems.append(f"{entry}: not a Megatron attention backend; use one of "
                                f"{', '.join(ATTENTION_BACKENDS)}")  # fmt: skip
        elif name in DEFAULT_ONLY:
            works, feature = DEFAULT_ONLY[name]
            if value != works or type(value) is not type(works):
                problems.append(
                    f"{entry}: {feature} are not supported yet (megarl's HF mapping, resharding "
                    f"and checkpoints split the layers evenly over {prefix}."
                    f"pipeline_model_parallel_size); use {_show(works)}"
                )
        elif name in FROM_HF:
            problems.append(
                f"{entry}: the model's shape comes from its config.json (megarl's HF weight "
                "mapping reads it); leave it out"
            )
        elif name in LAYOUT:
            problems.append(f"{entry}: the layout is {prefix}.{name}; set that instead")
        else:
            problems.append(
                f"{key}.{name} is not passed to TransformerConfig by megarl; it takes "
                f"{', '.join(MEGARL_KEYS)} (megarl's megatron.* keys), attention_backend, moe_*, "
                f"{', '.join(DEFAULT_ONLY)} at Megatron's defaults and {', '.join(NO_EFFECT)} "
                "(no effect)"
            )
    return problems
