"""Build Megatron-Core ``GPTModel`` actors and critics from a Hugging Face ``config.json``.

Megatron objects are built directly: this module translates the HF architecture
(:class:`megarl.config.model_dims.ModelDims`) into a ``TransformerConfig`` and a layer spec, and
builds one model chunk per virtual pipeline stage. ``transformer_impl: auto`` is Transformer
Engine's spec on CUDA (an error saying why if TE does not import) and the local spec on CPU;
fusions (:class:`Fusions`) are on wherever the spec allows them.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megarl.config.model_dims import ModelDims, UnsupportedArchitectureError
from megarl.config.transformer_overrides import TE_ONLY_MOE, moe_override_problem
from megarl.models import rope
from megarl.models.chunks import chunks_device, unwrap  # noqa: F401 -- re-exported

TransformerImpl = Literal["auto", "local", "transformer_engine"]


TE_INSTALL_HINT = "GPU install: `make venv-gpu` (README, 'GPU install')"


@functools.cache
def transformer_engine_import_error() -> str | None:
    """None when Transformer Engine's PyTorch extension imports, else why not, in one line."""
    return _import_error(_import_transformer_engine)


def _import_transformer_engine() -> None:
    import transformer_engine.pytorch  # noqa: F401


def _import_error(do_import: Callable[[], object]) -> str | None:
    try:
        do_import()
    except Exception as exc:  # noqa: BLE001 - every failure is reported, with its reason
        return f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    return None


def transformer_engine_available() -> bool:
    """True when Transformer Engine imports and CUDA is available (TE needs both)."""
    return torch.cuda.is_available() and transformer_engine_import_error() is None


@functools.cache
def apex_fused_wgrad_available() -> bool:
    """True when apex's ``fused_weight_gradient_mlp_cuda`` imports: Megatron's own linears (the
    output layer) need it for ``gradient_accumulation_fusion``, and the one flag turns the fusion
    off for every linear, Transformer Engine's included, when it is missing."""

    def do_import() -> None:
        import fused_weight_gradient_mlp_cuda  # noqa: F401

    return _import_error(do_import) is None


def resolve_transformer_impl(
    impl: TransformerImpl,
    *,
    cuda: bool | None = None,
    te_import_error: str | None | Callable[[], str | None] = transformer_engine_import_error,
) -> Literal["local", "transformer_engine"]:
    """The layer spec to build: ``local`` or ``transformer_engine``.

    ``auto`` is the local spec without CUDA and Transformer Engine's with it. Transformer Engine
    asked for (``transformer_engine``) or expected (``auto`` on CUDA) but not importable is an
    error that says why in one line, never a silent fallback to the slow local spec.

    ``cuda`` (default: ``torch.cuda.is_available()``) and ``te_import_error`` (the import's
    failure reason, or None when it imports; a callable is asked only when TE is needed) are
    parameters so that the decision can be checked without a GPU.
    """
    if impl not in ("auto", "local", "transformer_engine"):
        raise ValueError(
            f"megatron.transformer_impl must be auto, local or transformer_engine, not {impl!r}"
        )
    if impl == "local":
        return "local"
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if impl == "auto" and not cuda:
        return "local"
    error = te_import_error() if callable(te_import_error) else te_import_error
    if error is None and not cuda:
        error = "CUDA is not available (Transformer Engine runs on NVIDIA GPUs only)"
    if error is not None:
        expected = "asks for" if impl == "transformer_engine" else "on CUDA expects"
        raise RuntimeError(
            f"megatron.transformer_impl={impl} {expected} Transformer Engine, which does not "
            f"import: {error}. {TE_INSTALL_HINT}; megatron.transformer_impl=local runs the slow "
            "local spec instead"
        )
    return "transformer_engine"


@dataclass(frozen=True)
class Fusions:
    """Megatron fusions and pipeline memory savings, each applied where the spec allows it.

    Every field is the ``TransformerConfig`` field of the same name; True means "on wherever
    it can run" (:func:`fusion_flags` decides), False forces it off.
    """

    bias_activation_fusion: bool = True
    """Fused bias-SwiGLU: Transformer Engine spec only (the local spec keeps plain ops)."""
    apply_rope_fusion: bool = True
    """Transformer Engine's fused RoPE kernel: TE spec only."""
    gradient_accumulation_fusion: bool = True
    """Weight-gradient GEMMs accumulate straight into the fp32 main gradient: TE spec, and only
    when apex's ``fused_weight_gradient_mlp_cuda`` imports (Megatron's output layer needs it)."""
    deallocate_pipeline_outputs: bool = True
    """Free a stage's output activations once sent to the next stage: PP > 1 only."""
    attention_backend: str = "auto"
    """Transformer Engine's attention kernel, Megatron's ``AttnBackend`` name (verl's
    ``override_transformer_config.attention_backend``): TE spec only; the local spec has one
    attention, Megatron's own."""


def fusion_flags(
    fusions: Fusions,
    impl: Literal["local", "transformer_engine"],
    *,
    pipeline_model_parallel_size: int,
    apex_wgrad: bool | None = None,
) -> dict[str, bool]:
    """The ``TransformerConfig`` values of :class:`Fusions` for this spec and layout.

    ``apex_wgrad`` (default: :func:`apex_fused_wgrad_available`) is a parameter so that the
    decision can be checked without apex.
    """
    te = impl == "transformer_engine"
    if apex_wgrad is None:
        apex_wgrad = te and apex_fused_wgrad_available()
    backend = {"attention_backend": AttnBackend[fusions.attention_backend]} if te else {}
    return {
        **backend,
        "bias_activation_fusion": fusions.bias_activation_fusion and te,
        "apply_rope_fusion": fusions.apply_rope_fusion and te,
        "gradient_accumulation_fusion": fusions.gradient_accumulation_fusion and te and apex_wgrad,
        "deallocate_pipeline_outputs": (
            fusions.deallocate_pipeline_outputs and pipeline_model_parallel_size > 1
        ),
    }


def build_transformer_config(
    dims: ModelDims,
    *,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    context_parallel_size: int = 1,
    sequence_parallel: bool = False,
    params_dtype: torch.dtype = torch.float32,
    recompute_granularity: str | None = None,
    recompute_method: str | None = None,
    recompute_num_layers: int | None = None,
    recompute_modules: tuple[str, ...] = ("core_attn",),
    transformer_impl: TransformerImpl = "auto",
    fusions: Fusions | None = None,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
    moe: MoeSettings | None = None,
    pipeline_split: dict[str, Any] | None = None,
) -> TransformerConfig:
    """TransformerConfig for a Llama/Qwen-family model on the current parallel grid.

    ``pipeline_split``: Megatron's uneven layer split fields, as given
    (:meth:`megarl.parallel.layout.ParallelLayout.pipeline_split`; empty: the even split).

    ``fusions`` (default: all on where the spec allows, :func:`fusion_flags`) picks the fused
    kernels and pipeline memory savings.

    A MoE model (``dims.num_experts`` > 0) gets its router from the HF config
    (:func:`moe_config_fields`) and ``moe``'s settings (verl's ``moe_*`` knobs).

    Dropout is taken from the architecture (0.0 for these families; Megatron defaults to 0.1).
    ``calculate_per_token_loss`` is on: the loss-scaling contract built on it is stated once, in
    :mod:`megarl.models.runner`.
    """
    on_gpu = torch.cuda.is_available()
    impl = resolve_transformer_impl(transformer_impl)
    vpp = (virtual_pipeline_model_parallel_size or 1) > 1
    moe_fields = moe_config_fields(
        dims,
        moe or MoeSettings(),
        expert_model_parallel_size=expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size or tensor_model_parallel_size,
        transformer_engine=impl == "transformer_engine",
    )
    # The allgather dispatcher refuses variable_seq_lengths: every micro-batch of a batch then
    # has the batch's longest length (the runner pads them, as for VPP).
    fixed_lengths = vpp or moe_fields.get("moe_token_dispatcher_type") == "allgather"
    return TransformerConfig(
        num_layers=dims.num_layers,
        hidden_size=dims.hidden_size,
        ffn_hidden_size=dims.ffn_hidden_size,
        num_attention_heads=dims.num_attention_heads,
        num_query_groups=dims.num_query_groups,
        kv_channels=dims.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=dims.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=dims.qkv_bias,
        qk_layernorm=dims.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        context_parallel_size=context_parallel_size,
        sequence_parallel=sequence_parallel and tensor_model_parallel_size > 1,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=not on_gpu,
        perform_initialization=True,
        # Interleaved (VPP) pipelines exchange shapes with batched p2p ops, which mismatch when
        # a stage's previous and next ranks are the same process (PP=2): there, micro-batches
        # are padded to one length and the unbatched, parity-ordered p2p path is used.
        variable_seq_lengths=not fixed_lengths,
        batch_p2p_comm=not vpp,
        calculate_per_token_loss=True,
        # The local (CPU) spec keeps the plain implementations: the fused kernels need TE or
        # apex (fusion_flags). Masked-softmax and persistent-layer-norm fusions are apex kernels
        # of the local spec; TE's attention and norms replace them.
        masked_softmax_fusion=False,
        bias_dropout_fusion=impl == "transformer_engine",
        persist_layer_norm=False,
        **fusion_flags(
            fusions or Fusions(), impl, pipeline_model_parallel_size=pipeline_model_parallel_size
        ),
        recompute_granularity=recompute_granularity,
        recompute_method=recompute_method,
        recompute_num_layers=recompute_num_layers,
        recompute_modules=list(recompute_modules),
        transformer_impl="transformer_engine" if impl == "transformer_engine" else "local",
        **moe_fields,
        **(pipeline_split or {}),
    )


@dataclass(frozen=True)
class MoeSettings:
    """verl's MoE knobs (``override_transformer_config.moe_*``): ``TransformerConfig`` fields
    passed through as given, after the router settings the HF config fixes.

    Refused here, in one line: names that are not ``TransformerConfig`` ``moe_*`` fields,
    the router fields the HF config decides (top-k, pre-softmax, score function, router dtype),
    and dispatchers other than :data:`megarl.config.transformer_overrides.MOE_DISPATCHERS`.
    """

    overrides: tuple[tuple[str, Any], ...] = ()
    """(field, value) pairs, e.g. ``(("moe_aux_loss_coeff", 0.001),)``."""

    @classmethod
    def from_dict(cls, overrides: dict[str, Any]) -> MoeSettings:
        return cls(tuple(sorted(overrides.items())))

    def checked(self) -> dict[str, Any]:
        """The overrides as a dict, after the checks above (``ValueError`` naming the key)."""
        known = {f.name for f in dataclasses.fields(TransformerConfig)}
        out = dict(self.overrides)
        for key, value in out.items():
            if not key.startswith("moe_") or key not in known:
                raise ValueError(
                    f"override_transformer_config.{key}: not a TransformerConfig moe_* field"
                )
            problem = moe_override_problem(key, value)  # validation's own check, again here
            if problem is not None:
                raise ValueError(f"override_transformer_config.{problem}")
        return out


def moe_config_fields(
    dims: ModelDims,
    moe: MoeSettings,
    *,
    expert_model_parallel_size: int,
    expert_tensor_parallel_size: int,
    transformer_engine: bool,
) -> dict[str, Any]:
    """The ``TransformerConfig`` MoE fields of ``dims`` (only the parallel sizes for a dense model).

    Router semantics as in transformers: logits in fp32, softmax, top-k. Renormalised top-k
    probabilities (Mixtral; Qwen3-MoE with ``norm_topk_prob``) are Megatron's
    ``moe_router_pre_softmax=False`` (softmax over the top-k logits, the same numbers); the full
    softmax's top-k values (Qwen3-MoE without it) are ``pre_softmax=True``. Token dropping is off
    (dropless) unless a capacity factor is set; the aux loss is Megatron's default (coefficient
    0) unless set. The Transformer Engine spec uses grouped GEMM (``TEGroupedMLP``).
    """
    sizes = {
        "expert_model_parallel_size": expert_model_parallel_size,
        "expert_tensor_parallel_size": expert_tensor_parallel_size,
    }
    if not dims.is_moe:
        return {**sizes, "moe_token_dispatcher_type": "alltoall"}
    return {
        **sizes,
        "num_moe_experts": dims.num_experts,
        "moe_ffn_hidden_size": dims.moe_ffn_hidden_size,
        "moe_router_topk": dims.moe_router_topk,
        "moe_router_pre_softmax": not dims.moe_renormalize_topk,
        "moe_router_score_function": "softmax",
        "moe_router_dtype": "fp32",
        "moe_grouped_gemm": transformer_engine,
        "moe_token_dispatcher_type": "alltoall",
        "moe_shared_expert_intermediate_size": dims.moe_shared_expert_ffn_hidden_size or None,
        "moe_shared_expert_gate": bool(dims.moe_shared_expert_ffn_hidden_size),
        **{
            k: v for k, v in moe.checked().items() if transformer_engine or k not in TE_ONLY_MOE
        },  # TE's kernels: TE spec only
    }


def layer_spec(dims: ModelDims, transformer_impl: TransformerImpl = "auto"):
    """Megatron layer spec: Transformer Engine's when available/asked for, else the local one.

    MoE layers: ``TEGroupedMLP`` (grouped GEMM) on the TE spec, ``SequentialMLP`` (one local
    ``MLP`` per expert) on the local spec. The local spec's core attention is
    :class:`~megarl.models.attention.PackedDotProductAttention` (packed rows, CP).
    """
    experts = dims.num_experts or None
    if resolve_transformer_impl(transformer_impl) == "transformer_engine":
        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=experts is not None, qk_layernorm=dims.qk_norm
        )
    if experts is not None:
        _define_te_general_gemm()
    spec = get_gpt_layer_local_spec(
        num_experts=experts, qk_layernorm=dims.qk_norm, normalization="RMSNorm"
    )
    # Packed rows and context parallelism are TE's on GPU; the local spec gets megarl's exact
    # emulation of both (Megatron's local attention refuses them).
    from megarl.models.attention import PackedDotProductAttention

    layer, attention = spec.submodules, spec.submodules.self_attention.submodules
    attention.core_attention = PackedDotProductAttention
    for owner, name in ((layer, "input_layernorm"), (layer, "pre_mlp_layernorm"),
                        (attention, "q_layernorm"), (attention, "k_layernorm")):  # fmt: skip
        if getattr(owner, name) is WrappedTorchNorm:
            setattr(owner, name, TorchNorm)
    return spec


class TorchNorm:
    """The local spec's norm (Megatron's ``WrappedTorchNorm``: a plain torch RMSNorm) under
    sequence parallelism too. Megatron's wrapper refuses sequence parallelism only because a
    torch norm does not mark its weight for the TP all-reduce of its gradient (each TP rank then
    normalises its own part of the sequence); :func:`build_gpt_chunks` sets that mark
    (``sequence_parallel``), as Transformer Engine's and apex's norms do, and Megatron's
    ``finalize_model_grads`` sums those gradients over TP. Without sequence parallelism it is
    Megatron's wrapper unchanged."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **kwargs):
        if config.sequence_parallel:
            config = copy.copy(config)  # only for the wrapper's refusal
            config.sequence_parallel = False
        return WrappedTorchNorm(config, hidden_size, eps, **kwargs)


def _block_spec(spec, config: TransformerConfig, vp_stage: int | None):
    """The layer spec as this stage's block (Megatron's own expansion of a layer spec) with the
    final norm :class:`TorchNorm` where Megatron would build its torch wrapper."""
    from megatron.core.transformer import transformer_block as tb

    if tb.LayerNormImpl is not WrappedTorchNorm:
        return spec
    layers = tb.get_num_layers_to_build(config, vp_stage=vp_stage)
    return tb.TransformerBlockSubmodules(layer_specs=[spec] * layers, layer_norm=TorchNorm)


def _define_te_general_gemm() -> None:
    """Megatron-Core 0.16.1's ``moe_utils`` imports ``te_general_gemm`` only with Transformer
    Engine yet tests ``te_general_gemm is not None`` in the router's fp32 GEMM (a NameError
    without TE): without TE it is None, which selects the plain ``torch.mm`` path."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


_LLAMA3_ROPE_DEFAULTS = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def llama3_rope_factor(dims: ModelDims) -> float | None:
    """The Llama-3.1 RoPE scaling factor, None for plain RoPE.

    Megatron's ``rope_scaling`` implements exactly Llama 3.1's scheme with fixed low/high
    frequency factors and original length; anything else is refused rather than approximated.
    """
    if not dims.rope_scaling:
        return None
    scaling = dict(dims.rope_scaling)
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return None
    mismatched = {
        k: scaling.get(k) for k, v in _LLAMA3_ROPE_DEFAULTS.items() if float(scaling.get(k, v)) != v
    }
    if kind != "llama3" or mismatched:
        raise UnsupportedArchitectureError(
            f"{dims.architecture} with rope_scaling={scaling} (supported: none, or llama3 with "
            f"{_LLAMA3_ROPE_DEFAULTS})"
        )
    return float(scaling["factor"])


class ValueHead(torch.nn.Module):
    """Scalar value head replacing ``GPTModel.output_layer`` for the critic (and a reward model).

    Replicated on every TP rank. With sequence parallelism the hidden states reaching the output
    layer are sequence-sharded: the head first gathers them from the sequence-parallel region
    with a *split* backward (not Megatron's default reduce-scatter, which assumes a TP-split
    consumer), so every TP rank computes the same full-sequence values and the same weight
    gradient, which then needs no reduction over TP (correct by construction). Called with the
    output layer's signature.
    """

    def __init__(
        self, hidden_size: int, dtype: torch.dtype, seed: int = 0, sequence_parallel: bool = False
    ) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        weight = torch.randn(1, hidden_size, generator=gen) / hidden_size**0.5
        self.weight = torch.nn.Parameter(weight.to(dtype))
        self.weight.sequence_parallel = False  # type: ignore[attr-defined]
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False
            )
        return F.linear(hidden_states, self.weight.to(hidden_states.device)), None


def build_gpt_chunks(
    dims: ModelDims,
    config: TransformerConfig,
    *,
    transformer_impl: TransformerImpl = "auto",
    value_head: bool = False,
    value_head_seed: int = 0,
) -> list[GPTModel]:
    """Build this rank's model chunks (one per virtual pipeline stage, one without VPP).

    ``value_head=True`` gives the critic: the same backbone with a scalar head instead of the
    vocabulary projection (embeddings are then never shared with the output).
    """
    vpp = config.virtual_pipeline_model_parallel_size or 1
    rope_factor = llama3_rope_factor(dims)
    spec = layer_spec(dims, transformer_impl)
    rope.install()  # packed rows' rotary embedding built once per forward, not per layer
    if config.num_moe_experts:
        from megarl.models import router_losses

        router_losses.install()  # the routers' losses at full strength at any TP×CP
    chunks: list[GPTModel] = []
    for vp_stage in range(vpp):
        vp = vp_stage if vpp > 1 else None
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp)
        model = GPTModel(
            config=config,
            transformer_layer_spec=_block_spec(spec, config, vp),
            vocab_size=dims.padded_vocab_size,
            max_sequence_length=dims.max_position_embeddings,
            pre_process=pre,
            post_process=post,
            parallel_output=True,
            share_embeddings_and_output_weights=dims.tie_word_embeddings and not value_head,
            position_embedding_type="rope",
            rotary_percent=1.0,
            rotary_base=int(dims.rope_theta),
            rope_scaling=rope_factor is not None,
            rope_scaling_factor=rope_factor or 8.0,
            vp_stage=vp,
        )
        if value_head and post:
            model.output_layer = ValueHead(
                dims.hidden_size, config.params_dtype, value_head_seed, config.sequence_parallel
            )
        # The local spec builds torch.nn.RMSNorm without params_dtype (fp32 norms in a bf16 or
        # float64 model); Transformer Engine's norms take params_dtype. Match TE, so the CPU
        # path holds the GPU path's dtypes (and one gradient-buffer dtype).
        # Under sequence parallelism their gradients are partial sums over TP (TorchNorm).
        for module in model.modules():
            if isinstance(module, torch.nn.RMSNorm):
                module.to(config.params_dtype)
                module.weight.sequence_parallel = config.sequence_parallel
        if not config.perform_initialization:
            mark_tensor_parallel_weights(model)
        if torch.cuda.is_available():
            model.cuda(torch.cuda.current_device())
        chunks.append(model)
    return chunks


def mark_tensor_parallel_weights(model: torch.nn.Module) -> None:
    """Set ``tensor_model_parallel`` / ``partition_dim`` on the weights of TP-split layers.

    Megatron sets these attributes only inside its weight initialisers, which do not run with
    ``perform_initialization=False`` (megarl skips them when it loads weights anyway). Without
    them Megatron takes every TP shard for a replicated tensor: its gradient norm (and so the
    clipping) counts only TP rank 0's shards. Column-parallel layers and the vocabulary split
    dimension 0, row-parallel layers dimension 1 (Transformer Engine's linears say which by
    ``parallel_mode``).
    """
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )

    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.nn.Parameter):
            continue
        mode = getattr(module, "parallel_mode", None)
        if isinstance(module, ColumnParallelLinear | VocabParallelEmbedding) or mode == "column":
            dim = 0
        elif isinstance(module, RowParallelLinear) or mode == "row":
            dim = 1
        else:
            continue
        weight.tensor_model_parallel = True  # type: ignore[attr-defined]
        weight.partition_dim = dim  # type: ignore[attr-defined]
        weight.partition_stride = getattr(weight, "partition_stride", 1)  # type: ignore[attr-defined]


def layer_offset(config: TransformerConfig, vp_stage: int | None) -> int:
    """Global index of this rank's first layer in chunk ``vp_stage`` (Megatron's own logic)."""
    vp = vp_stage if (config.virtual_pipeline_model_parallel_size or 1) > 1 else None
    return get_transformer_layer_offset(config, vp_stage=vp)
