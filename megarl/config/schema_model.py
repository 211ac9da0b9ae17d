"""The ``*.model`` sections of the typed config tree: the HF model, its expected shape and the
actor's LoRA adapters (:mod:`megarl.config.schema` holds the rest and the root)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ArchitectureConfig:
    """``*.model.architecture`` (megarl): model shape, for validation without the model files.

    The keys are the HF ``config.json`` names and are parsed by the same parser into the one
    model-shape type (:func:`megarl.config.model_dims.known_dims`; complete sections also give
    a :class:`~megarl.config.model_dims.ModelDims`). When the model path exists its
    ``config.json`` is the source of truth and every value given here must agree with it; when
    it does not exist (validating a 72B config on a laptop) these values are used instead.
    """

    architecture: str | None = None
    """HF architecture class (config.json architectures[0]), e.g. Qwen2ForCausalLM."""

    num_attention_heads: int | None = None
    """Query heads (HF num_attention_heads)."""
    num_key_value_heads: int | None = None
    """KV heads, Megatron's query groups (HF num_key_value_heads)."""
    num_hidden_layers: int | None = None
    """Transformer layers (HF num_hidden_layers)."""
    hidden_size: int | None = None
    """Hidden width (HF hidden_size)."""
    vocab_size: int | None = None
    """Vocabulary size before Megatron's padding (HF vocab_size)."""
    max_position_embeddings: int | None = None
    """Longest sequence the model supports (HF max_position_embeddings)."""
    num_experts: int | None = None
    """Routed experts of a MoE model; null or 0: dense."""
    intermediate_size: int | None = None
    """MLP width (HF intermediate_size; Megatron ffn_hidden_size)."""
    head_dim: int | None = None
    """Channels per attention head; null: hidden_size / num_attention_heads."""
    tie_word_embeddings: bool | None = None
    """Output layer shares the embedding weight (HF tie_word_embeddings)."""


@dataclass
class LoraConfig:
    """``actor_rollout_ref.model.lora.*`` (verl's Megatron LoRA keys): adapters on the actor's
    linears (:mod:`megarl.models.lora`, docs/lora.md); ``rank`` 0 trains full weights."""

    type: str = "lora"
    """Only lora (one adapter per fused linear); canonical_lora, vlm_lora, dora are refused."""
    rank: int = 0
    """Adapter rank; 0: no adapters."""
    alpha: float = 32
    """Adapter outputs are scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout probability on the adapter path."""
    dropout_position: str = "pre"
    """pre: dropout on the adapter's input; post: on its output."""
    target_modules: list[str] = field(
        default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    )
    """Megatron linears that get adapters (of linear_qkv, linear_proj, linear_fc1, linear_fc2)."""
    exclude_modules: list[str] = field(default_factory=list)
    """With target_modules empty (as verl requires): every linear but these."""
    lora_A_init_method: str = "xavier"
    """Initialisation of A: xavier, kaiming, normal or zero."""
    lora_B_init_method: str = "zero"
    """Initialisation of B (zero: step 0 equals the base model)."""
    merge: bool = False
    """true: syncs send base + adapters merged; false (verl's default): the base once, then adapters."""
    adapter_path: str | None = None
    """Start from a saved PEFT adapter folder (adapter_config.json + adapter_model.safetensors)."""
    a2a_experimental: bool = False
    """Only false: no all-to-all adapter communication."""
    dtype: str | None = None
    """Only null: adapters take the model's dtype."""
    fully_sharded_loras: bool = False
    """vLLM's fully_sharded_loras (merge=false only)."""
    freeze_vision_model: bool = True
    """No effect: text models only."""
    freeze_vision_projection: bool = True
    """No effect: text models only."""
    freeze_language_model: bool = True
    """No effect: text models only (the base is always frozen)."""


@dataclass
class ModelConfig:
    """``actor_rollout_ref.model.*`` and ``critic.model.*``: which Hugging Face model to load."""

    path: str | None = None
    """Local directory or hub id of the HF model (required for the actor)."""
    tokenizer_path: str | None = None
    """Tokenizer location; null: path."""
    trust_remote_code: bool = False
    """Let code shipped with the checkpoint (a custom tokenizer) run: transformers' and vLLM's."""
    # The model itself is always megarl's own build of a supported architecture (config.json's
    # architectures); another architecture is refused at pre-flight whatever this says.
    # verl 0.9.1 applies this key on its FSDP engine only; its Megatron engine reads recompute
    # from megatron.recompute_* (verl #1064). megarl does the same; validation warns when it is
    # true and megatron.recompute_granularity is unset.
    enable_gradient_checkpointing: bool | None = None
    """No effect, as in verl 0.9.1's Megatron workers: recompute is megatron.recompute_granularity."""
    override_config: dict[str, Any] = field(default_factory=dict)
    """Free-form: HF config fields to override (e.g. attention_dropout)."""
    use_fused_kernels: bool = False
    """No effect, either value: log-probs and entropy are always computed vocab-parallel in chunks."""
    use_remove_padding: bool = True
    """Pack each micro-batch's sequences into one row without padding (THD); false: right-padded."""
    external_lib: str | None = None
    """Only null: no custom modelling code is imported."""
    custom_chat_template: str | None = None
    """Only null: the tokenizer's own chat template is used."""
    use_shm: bool = False
    """Only false: models load from the filesystem."""
    enable_activation_offload: bool = False
    """Only false: no activation offloading."""
    use_liger: bool = False
    """Only false: no Liger kernels (fusions follow megatron.transformer_impl)."""
    hf_config_path: str | None = None
    """Only null or the model path: config.json is read from the model path."""
    fused_kernel_options: dict[str, Any] = field(default_factory=dict)
    """Free-form; no effect, any value (fusions follow megatron.transformer_impl)."""
    architecture: ArchitectureConfig = field(default_factory=ArchitectureConfig)
    """(megarl) Expected model shape; checked against config.json, used when it is absent."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters (actor only; the critic's must keep rank 0)."""
