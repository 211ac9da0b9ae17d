"""The one model-shape type, :class:`ModelDims`, and the one reader and parser of HF configs.

``read_hf_config`` reads a ``config.json`` as it is; ``known_dims`` parses the shape fields an HF
config (or a ``*.model.architecture`` section) holds, as a *partial* shape (a dict of the known
``ModelDims`` fields: enough for layout checks on a laptop); ``ModelDims.from_hf_config`` parses
a complete one and refuses what the HF↔Megatron mapping cannot convert. Torch-free, so
validation, conversion checks, the resharding plan and the model builder share it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
)

MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM")
"""Mixture-of-experts families: every layer's MLP is a top-k routed set of SwiGLU experts."""

_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
}
"""HF ``model_type`` of each supported architecture (``transformers`` loads by model_type)."""

SEQUENCE_CLASSIFIERS = {
    "LlamaForSequenceClassification": "LlamaForCausalLM",
    "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
}
"""Reward-model architectures (a scalar ``score`` head on the backbone) -> the causal LM with
the same backbone. Their dims are the backbone's; ``architecture`` keeps the classifier's name."""

EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
"""HF keys that hold the routed-expert count of MoE models."""

_REQUIRED_HF_KEYS = {
    "hidden_size": "hidden_size",
    "ffn_hidden_size": "intermediate_size",
    "num_layers": "num_hidden_layers",
    "num_attention_heads": "num_attention_heads",
    "vocab_size": "vocab_size",
}
"""ModelDims field -> the HF key it is read from, for fields without a default."""


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


def read_hf_config(path: str | Path) -> dict:
    """The ``config.json`` of an HF model directory (or the file itself), unchanged.

    Raises ``FileNotFoundError`` naming the path, ``ValueError`` for invalid JSON.
    """
    path = Path(path)
    config_json = path / "config.json" if path.is_dir() else path
    if not config_json.is_file():
        raise FileNotFoundError(f"no config.json in {path}")
    try:
        data = json.loads(config_json.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{config_json} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{config_json} does not hold a JSON object")  # noqa: TRY004 - bad input
    return data


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def _text_part(cfg: Any) -> Any:
    """The language-model part of a multimodal config (``text_config``), else ``cfg``."""
    text = _get(cfg, "text_config")
    if isinstance(text, Mapping) and _get(cfg, "num_attention_heads") is None:
        return {**dict(cfg), **text} if isinstance(cfg, Mapping) else text
    return cfg


def known_dims(hf_config: Mapping[str, Any] | Any) -> dict[str, Any]:
    """Every :class:`ModelDims` field an HF config (dict or ``PretrainedConfig``) determines.

    Missing keys are left out, except where HF itself has a default: KV heads default to the
    query heads, ``head_dim`` to ``hidden_size / num_attention_heads``, no experts to 0.
    ``padded_vocab_size`` is not included (it depends on the training TP).
    """
    cfg = _text_part(hf_config)
    out: dict[str, Any] = {}
    for field_name, key in _REQUIRED_HF_KEYS.items():
        if _get(cfg, key) is not None:
            out[field_name] = int(_get(cfg, key))
    heads = out.get("num_attention_heads")
    groups = _get(cfg, "num_key_value_heads") or heads
    if groups is not None:
        out["num_query_groups"] = int(groups)
    head_dim = _get(cfg, "head_dim")
    if head_dim is None and heads and "hidden_size" in out:
        head_dim = out["hidden_size"] // heads
    if head_dim is not None:
        out["head_dim"] = int(head_dim)
    if _get(cfg, "max_position_embeddings") is not None:
        out["max_position_embeddings"] = int(_get(cfg, "max_position_embeddings"))
    experts = next((_get(cfg, k) for k in EXPERT_KEYS if _get(cfg, k) is not None), None)
    out["num_experts"] = int(experts or 0)
    archs = _get(cfg, "architectures") or []
    if len(archs) == 1:
        out["architecture"] = str(archs[0])
    if _get(cfg, "tie_word_embeddings") is not None:
        out["tie_word_embeddings"] = bool(_get(cfg, "tie_word_embeddings"))
    return out


@dataclass(frozen=True)
class ModelDims:
    """Shape facts of a decoder-only model (dense or MoE), shared by the HF and Megatron
    layouts."""

    hidden_size: int
    """H: model width."""
    ffn_hidden_size: int
    """F: MLP intermediate width (each of gate and up; HF ``intermediate_size``)."""
    num_layers: int
    """Number of transformer layers (HF ``num_hidden_layers``)."""
    num_attention_heads: int
    """nq: query heads."""
    num_query_groups: int
    """nkv: key/value heads (GQA groups; HF ``num_key_value_heads``)."""
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
    num_experts: int = 0
    """Routed experts (0: a dense model)."""
    moe_ffn_hidden_size: int = 0
    """Each expert's intermediate width (Qwen3-MoE ``moe_intermediate_size``, Mixtral
    ``intermediate_size``); 0 for dense models."""
    moe_router_topk: int = 0
    """Experts each token is routed to (HF ``num_experts_per_tok``); 0 for dense models."""
    moe_renormalize_topk: bool = False
    """Whether the top-k softmax probabilities are renormalised to sum to 1 (Mixtral always,
    Qwen2/Qwen3-MoE with ``norm_topk_prob``); otherwise they are the full softmax's values."""
    moe_shared_expert_ffn_hidden_size: int = 0
    """Qwen2-MoE's shared expert width (``shared_expert_intermediate_size``; its output is
    scaled by sigmoid(``shared_expert_gate``)); 0: no shared expert."""

    @property
    def is_moe(self) -> bool:
        """Whether the MLPs are routed experts."""
        return self.num_experts > 0

    @property
    def heads_per_group(self) -> int:
        """Query heads per KV group (nq / nkv)."""
        return self.num_attention_heads // self.num_query_groups

    @property
    def qkv_rows(self) -> int:
        """Rows of the full ``linear_qkv`` weight: (nq + 2·nkv)·d."""
        return (self.num_attention_heads + 2 * self.num_query_groups) * self.head_dim

    def known(self) -> dict[str, Any]:
        """All fields as the partial-shape dict (see :func:`known_dims`)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_hf_config(
        cls,
        hf_config: Mapping[str, Any] | Any,
        tp_size: int = 1,
        make_vocab_size_divisible_by: int = 128,
    ) -> ModelDims:
        """Read dimensions from an HF config (a ``config.json`` dict or a ``PretrainedConfig``).

        Raises :class:`UnsupportedArchitectureError` for anything other than the Llama / Qwen2 /
        Qwen3 (and Mistral without sliding window) dense causal LMs, the Qwen3-MoE and Mixtral
        (without sliding window) mixture-of-experts causal LMs, and the Llama / Qwen2
        ``*ForSequenceClassification`` reward models, and ``ValueError`` naming a missing or
        inconsistent key.
        """
        archs = _get(hf_config, "architectures") or []
        arch = (
            archs[0] if archs else f"<no architectures; model_type={_get(hf_config, 'model_type')}>"
        )
        name, arch = arch, SEQUENCE_CLASSIFIERS.get(arch, arch)
        if len(archs) != 1 or arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitectureError(
                f"unsupported architecture {', '.join(archs) or arch!s}; "
                f"supported: {', '.join([*SUPPORTED_ARCHITECTURES, *SEQUENCE_CLASSIFIERS])}"
            )
        model_type = _get(hf_config, "model_type")
        if model_type is not None and model_type != _MODEL_TYPES[arch]:
            raise ValueError(
                f"model_type={model_type!r} contradicts architectures=[{name!r}] "
                f"(expected model_type={_MODEL_TYPES[arch]!r})"
            )
        act = _get(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise UnsupportedArchitectureError(f"{arch} with hidden_act={act!r} (only silu/SwiGLU)")
        if _get(hf_config, "mlp_bias", False):
            raise UnsupportedArchitectureError(f"{arch} with mlp_bias=True")
        sliding = _get(hf_config, "sliding_window")
        uses_sliding = _get(
            hf_config, "use_sliding_window", arch in ("MistralForCausalLM", "MixtralForCausalLM")
        )
        if uses_sliding and sliding is not None:
            raise UnsupportedArchitectureError(f"{arch} with sliding_window={sliding}")

        known = known_dims(hf_config)
        missing = [key for name, key in _REQUIRED_HF_KEYS.items() if name not in known]
        if missing:
            raise ValueError(f"the HF config has no {', '.join(missing)}")
        heads, groups = known["num_attention_heads"], known["num_query_groups"]
        if heads % groups:
            raise ValueError(
                f"num_attention_heads={heads} not divisible by num_key_value_heads={groups}"
            )
        moe = _moe_fields(hf_config, arch, known)
        if arch == "Qwen2ForCausalLM":
            qkv_bias = True
        elif arch == "Qwen2MoeForCausalLM":
            qkv_bias = bool(_get(hf_config, "qkv_bias", True))
        else:
            qkv_bias = bool(_get(hf_config, "attention_bias", False))

        # transformers 5 moved rope_theta / rope_scaling into ``rope_parameters``.
        rope_params = dict(_get(hf_config, "rope_parameters") or {})
        rope_theta = _get(hf_config, "rope_theta") or rope_params.get("rope_theta") or 10000.0
        # (on a transformers-5 config object ``rope_scaling`` aliases ``rope_parameters``)
        scaling = dict(_get(hf_config, "rope_scaling") or rope_params)
        scaling.pop("rope_theta", None)
        if scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = {}
        return cls(
            hidden_size=known["hidden_size"],
            ffn_hidden_size=known["ffn_hidden_size"],
            num_layers=known["num_layers"],
            num_attention_heads=heads,
            num_query_groups=groups,
            head_dim=known["head_dim"],
            vocab_size=known["vocab_size"],
            padded_vocab_size=padded_vocab_size(
                known["vocab_size"], tp_size, make_vocab_size_divisible_by
            ),
            qkv_bias=qkv_bias,
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            tie_word_embeddings=known.get("tie_word_embeddings", False),
            norm_eps=float(_get(hf_config, "rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=known.get("max_position_embeddings", 4096),
            architecture=name,
            rope_scaling=tuple(sorted((str(k), v) for k, v in scaling.items())),
            **moe,
        )


def _moe_fields(hf_config: Mapping[str, Any] | Any, arch: str, known: dict) -> dict[str, Any]:
    """The MoE fields of :class:`ModelDims` (none for a dense architecture); refuses what the
    mapping cannot build: a dense layer among MoE layers, router input jitter."""
    if arch not in MOE_ARCHITECTURES:
        if known["num_experts"]:
            raise UnsupportedArchitectureError(f"{arch} with {known['num_experts']} experts")
        return {"num_experts": 0}
    experts, topk = known["num_experts"], _get(hf_config, "num_experts_per_tok")
    if not experts or not topk:
        raise ValueError(
            f"the {arch} config needs num_experts / num_local_experts and num_experts_per_tok"
        )
    shared = 0
    if arch in ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"):
        step, dense = _get(hf_config, "decoder_sparse_step", 1), _get(hf_config, "mlp_only_layers")
        if step != 1 or dense:
            raise UnsupportedArchitectureError(
                f"{arch} with decoder_sparse_step={step}, mlp_only_layers={dense} (every layer "
                "must be MoE)"
            )
        width = _get(hf_config, "moe_intermediate_size")
        if width is None:
            raise ValueError("the HF config has no moe_intermediate_size")
        renormalize = bool(_get(hf_config, "norm_topk_prob", False))
        if arch == "Qwen2MoeForCausalLM":
            shared = int(_get(hf_config, "shared_expert_intermediate_size") or 0)
            if not shared:
                raise ValueError("the HF config has no shared_expert_intermediate_size")
    else:
        width, renormalize = known["ffn_hidden_size"], True
    jitter = _get(hf_config, "router_jitter_noise", 0.0)
    if jitter:  # HF scales the experts' input too; Megatron's moe_input_jitter_eps the router's
        raise UnsupportedArchitectureError(f"{arch} with router_jitter_noise={jitter}")
    if topk > experts:
        raise ValueError(f"num_experts_per_tok={topk} exceeds the {experts} experts")
    return {
        "num_experts": int(experts),
        "moe_ffn_hidden_size": int(width),
        "moe_router_topk": int(topk),
        "moe_renormalize_topk": renormalize,
        "moe_shared_expert_ffn_hidden_size": shared,
    }
