"""Dimensions of a Llama / Qwen2 / Qwen3 / Mistral dense model, read from its HF config.

:class:`ModelDims` is what every layout function (:mod:`megarl.models.hf_mapping`), the model
builder (:mod:`megarl.models.gpt`) and the resharding plan need to know about an architecture;
reading it refuses anything the mapping cannot convert (:class:`UnsupportedArchitectureError`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
)


class UnsupportedArchitectureError(ValueError):
    """The HF config describes a model this mapping does not know how to convert."""


def padded_vocab_size(
    vocab_size: int, tp_size: int = 1, make_vocab_size_divisible_by: int = 128
) -> int:
    """Smallest multiple of ``make_vocab_size_divisible_by * tp_size`` that is ``>= vocab_size``.

    Same rule as Megatron's ``_vocab_size_with_padding``.
    """
    multiple = make_vocab_size_divisible_by * tp_size
    return int(math.ceil(vocab_size / multiple) * multiple)


def _cfg_get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


@dataclass(frozen=True)
class ModelDims:
    """Shape facts of a dense decoder-only model, shared by the HF and Megatron layouts."""

    hidden_size: int
    """H: model width."""
    ffn_hidden_size: int
    """F: MLP intermediate width (each of gate and up)."""
    num_layers: int
    """Number of transformer layers."""
    num_attention_heads: int
    """nq: query heads."""
    num_query_groups: int
    """nkv: key/value heads (GQA groups)."""
    head_dim: int
    """d: per-head width (Megatron ``kv_channels``)."""
    vocab_size: int
    """Rows of the HF embedding (config ``vocab_size``)."""
    padded_vocab_size: int
    """Rows of the Megatron embedding / output layer (zero padding past ``vocab_size``)."""
    qkv_bias: bool
    """Whether q/k/v projections have biases (Qwen2)."""
    qk_norm: bool
    """Per-head RMSNorm on q and k (Qwen3)."""
    tie_word_embeddings: bool
    """Output layer shares the embedding weight."""
    norm_eps: float
    """RMSNorm epsilon."""
    rope_theta: float
    """Rotary base."""
    max_position_embeddings: int
    """Maximum sequence length of the rotary table."""
    architecture: str
    """HF architecture name, e.g. ``Qwen2ForCausalLM``."""
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    """HF ``rope_scaling`` / non-default ``rope_parameters`` items (empty: plain RoPE)."""

    @property
    def heads_per_group(self) -> int:
        """Query heads per KV group (nq / nkv)."""
        return self.num_attention_heads // self.num_query_groups

    @property
    def qkv_rows(self) -> int:
        """Rows of the full ``linear_qkv`` weight: (nq + 2·nkv)·d."""
        return (self.num_attention_heads + 2 * self.num_query_groups) * self.head_dim

    @classmethod
    def from_hf_config(
        cls,
        hf_config: Mapping[str, Any] | Any,
        tp_size: int = 1,
        make_vocab_size_divisible_by: int = 128,
    ) -> ModelDims:
        """Read dimensions from an HF config (a ``config.json`` dict or a ``PretrainedConfig``).

        Raises :class:`UnsupportedArchitectureError` for anything other than the Llama / Qwen2 /
        Qwen3 (and Mistral without sliding window) dense causal LMs.
        """
        archs = _cfg_get(hf_config, "architectures") or []
        arch = (
            archs[0]
            if archs
            else f"<no architectures; model_type={_cfg_get(hf_config, 'model_type')}>"
        )
        if len(archs) != 1 or arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitectureError(
                f"unsupported architecture {', '.join(archs) or arch!s}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        act = _cfg_get(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise UnsupportedArchitectureError(f"{arch} with hidden_act={act!r} (only silu/SwiGLU)")
        if _cfg_get(hf_config, "mlp_bias", False):
            raise UnsupportedArchitectureError(f"{arch} with mlp_bias=True")
        sliding = _cfg_get(hf_config, "sliding_window")
        uses_sliding = _cfg_get(hf_config, "use_sliding_window", arch == "MistralForCausalLM")
        if uses_sliding and sliding is not None:
            raise UnsupportedArchitectureError(f"{arch} with sliding_window={sliding}")

        hidden = int(_cfg_get(hf_config, "hidden_size"))
        heads = int(_cfg_get(hf_config, "num_attention_heads"))
        groups = int(_cfg_get(hf_config, "num_key_value_heads") or heads)
        head_dim = _cfg_get(hf_config, "head_dim") or hidden // heads
        if heads % groups:
            raise ValueError(
                f"num_attention_heads={heads} not divisible by num_key_value_heads={groups}"
            )

        if arch == "Qwen2ForCausalLM":
            qkv_bias = True
        else:
            qkv_bias = bool(_cfg_get(hf_config, "attention_bias", False))

        # transformers 5 moved rope_theta / rope_scaling into ``rope_parameters``.
        rope_params = dict(_cfg_get(hf_config, "rope_parameters") or {})
        rope_theta = _cfg_get(hf_config, "rope_theta") or rope_params.get("rope_theta") or 10000.0
        # (on a transformers-5 config object ``rope_scaling`` aliases ``rope_parameters``)
        scaling = dict(_cfg_get(hf_config, "rope_scaling") or rope_params)
        scaling.pop("rope_theta", None)
        if scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = {}
        rope_scaling = tuple(sorted((str(k), v) for k, v in scaling.items()))

        vocab = int(_cfg_get(hf_config, "vocab_size"))
        return cls(
            hidden_size=hidden,
            ffn_hidden_size=int(_cfg_get(hf_config, "intermediate_size")),
            num_layers=int(_cfg_get(hf_config, "num_hidden_layers")),
            num_attention_heads=heads,
            num_query_groups=groups,
            head_dim=int(head_dim),
            vocab_size=vocab,
            padded_vocab_size=padded_vocab_size(vocab, tp_size, make_vocab_size_divisible_by),
            qkv_bias=qkv_bias,
            qk_norm=arch == "Qwen3ForCausalLM",
            tie_word_embeddings=bool(_cfg_get(hf_config, "tie_word_embeddings", False)),
            norm_eps=float(_cfg_get(hf_config, "rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(_cfg_get(hf_config, "max_position_embeddings", 4096)),
            architecture=arch,
            rope_scaling=rope_scaling,
        )
