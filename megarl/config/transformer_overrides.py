"""``*.megatron.override_transformer_config``: the Megatron ``TransformerConfig`` fields a verl
script sets directly (verl applies them over the config it builds from the HF model).

megarl takes an allow-list, each entry honoured or refused in one line, never dropped silently:

- :data:`MEGARL_KEYS`: megarl's own ``megatron.*`` keys of the same name (recompute, fusions),
  moved there by :mod:`megarl.config.spellings`;
- :data:`PASSED`: passed to ``TransformerConfig`` as given (attention backend, MoE knobs);
- :data:`NO_EFFECT`: accepted, changing no number (why given);
- :data:`PIPELINE_SPLIT_FIELDS`: Megatron's uneven layer split, part of the parallel layout
  (:meth:`megarl.config.schema.MegatronConfig.parallel_layout`), checked against the model by
  the layout rule; the critic and the reference model split as the actor;
- :data:`FROM_HF` and :data:`LAYOUT`: what megarl's HF weight mapping reads (the model's
  shape) or the parallel layout: refused, naming where the value comes from.
"""

from __future__ import annotations

from typing import Any

from megarl.parallel.layout import PIPELINE_SPLIT_FIELDS

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


HF_ROUTER_FIELDS = ("moe_router_topk", "moe_router_pre_softmax", "moe_router_score_function",
                    "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                    "moe_shared_expert_gate")  # fmt: skip
"""MoE fields the HF config fixes (the router's top-k, normalisation, softmax; the experts'
sizes); ``moe_router_dtype`` only at megarl's fp32."""

MOE_DISPATCHERS = ("alltoall", "allgather")
"""Token dispatchers that run on CPU (gloo) and GPU; ``flex`` needs DeepEP or HybridEP."""

TE_ONLY_MOE = ("moe_grouped_gemm", "moe_permute_fusion")
"""Transformer Engine's MoE kernels: applied on the TE spec, no effect on the local one."""


def deepep_available() -> bool:
    """DeepEP (``deep_ep``) or HybridEP imports: Megatron's flex dispatcher can run."""
    from importlib.util import find_spec

    return find_spec("deep_ep") is not None


def moe_override_problem(name: str, value: Any) -> str | None:
    """Why the ``moe_*`` entry ``name=value`` cannot apply (None: it can), naming what works."""
    if name in HF_ROUTER_FIELDS:
        return (f"{name}={_show(value)}: the router follows the HF config (top-k, "
                "normalisation, softmax; the experts' sizes too); leave it out")  # fmt: skip
    if name == "moe_router_dtype" and str(value) not in ("fp32", "float32"):
        return f"{name}={_show(value)}: megarl's router computes in fp32; use fp32"
    flex = (name == "moe_token_dispatcher_type" and value == "flex") or (
        name == "moe_enable_deepep" and value is True
    )
    if flex and not deepep_available():
        return (f"{name}={_show(value)}: the flex dispatcher needs DeepEP (deep_ep), which this "
                f"machine lacks; use a moe_token_dispatcher_type of {', '.join(MOE_DISPATCHERS)}")  # fmt: skip
    if name == "moe_token_dispatcher_type" and value not in (*MOE_DISPATCHERS, "flex"):
        return f"{name}={_show(value)}: use one of {', '.join((*MOE_DISPATCHERS, 'flex'))}"
    return None


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
        if name in NO_EFFECT:
            continue
        if name.startswith("moe_") and name not in FROM_HF:
            problem = moe_override_problem(name, value)
            if problem is not None:
                problems.append(f"{key}.{problem}")
        elif name == "attention_backend":
            if str(value).removeprefix("AttnBackend.") not in ATTENTION_BACKENDS:
                problems.append(f"{entry}: not a Megatron attention backend; use one of "
                                f"{', '.join(ATTENTION_BACKENDS)}")  # fmt: skip
        elif name in PIPELINE_SPLIT_FIELDS:
            continue  # part of the layout: checked against the model by the layout rule
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
                f"{', '.join(PIPELINE_SPLIT_FIELDS)} (the layer split) and "
                f"{', '.join(NO_EFFECT)} (no effect)"
            )
    return problems


def split_follows_actor_problems(
    prefix: str, meg: Any, actor_prefix: str, actor: Any, required: bool
) -> list[str]:
    """One line per layer-split entry of ``prefix``'s ``override_transformer_config`` that differs
    from the actor's (``required``: an absent entry too, as the critic's model is built at the
    actor's layout; the reference model takes the actor's split, so an absent entry is fine)."""
    key, mine, theirs = (
        "override_transformer_config",
        meg.override_transformer_config,
        actor.override_transformer_config,
    )
    defaults = dict(zip(PIPELINE_SPLIT_FIELDS, (None, None, False, False)))
    problems = []
    for name in PIPELINE_SPLIT_FIELDS:
        want = theirs.get(name, defaults[name])
        if name not in mine and not required:
            continue
        if mine.get(name, defaults[name]) != want:
            problems.append(
                f"{prefix}.{key}.{name}={_show(mine.get(name, defaults[name]))}: the layers split "
                f"as the actor's ({actor_prefix}.{key}.{name}={_show(want)}, one parallel "
                f"layout per process); set {_show(want)}"
            )
    return problems
