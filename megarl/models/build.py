"""The one way to build a model: HF path (or dims) + layout + dtype + role → this rank's chunks.

Every caller (trainer, conversion, tests) builds through :func:`build_model`, so the
``TransformerConfig``, layer spec, value head and weight loading are decided in one place.
Megatron's parallel state must already be initialised for ``layout``
(:func:`megarl.parallel.init.init_distributed`). Weights are loaded here, before any optimizer
exists: Megatron's bf16 optimizer clones fp32 main parameters when it is built, so weights
copied in afterwards would be reverted by its first step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from megatron.core import parallel_state
from megatron.core.transformer import TransformerConfig

from megarl.config.model_dims import ModelDims, read_hf_config
from megarl.models import moe_mapping as mm
from megarl.models.gpt import (
    Fusions,
    MoeSettings,
    TransformerImpl,
    build_gpt_chunks,
    build_transformer_config,
)
from megarl.models.weights import VALUE_HEAD_HF_NAME, HFCheckpointReader, load_hf_weights
from megarl.parallel.layout import ParallelLayout, shape_layout_problems

Role = Literal["actor", "critic", "reward"]


@dataclass(frozen=True)
class Recompute:
    """Megatron activation recomputation (``recompute_granularity`` None: off)."""

    granularity: Literal["full", "selective"] | None = None
    method: Literal["uniform", "block"] | None = None
    num_layers: int | None = None
    modules: tuple[str, ...] = ("core_attn",)
    """Selective recompute: the submodules recomputed (Megatron's ``recompute_modules``)."""

    @classmethod
    def of(cls, meg) -> Recompute:
        """A ``megatron`` config section's recompute keys."""
        return cls(meg.recompute_granularity, meg.recompute_method, meg.recompute_num_layers,
                   tuple(meg.recompute_modules))  # fmt: skip


@dataclass
class BuiltModel:
    """This rank's model chunks (one per virtual pipeline stage) and what they were built from."""

    dims: ModelDims
    chunks: list[torch.nn.Module]
    config: TransformerConfig
    layout: ParallelLayout
    role: Role
    hf_path: Path | None = None
    meta: dict = field(default_factory=dict)
    pack: bool = False
    """Run this model's passes on packed rows (THD, :mod:`megarl.models.packing`; the
    config's ``use_remove_padding``), else on right-padded ones."""
    _host: dict[int, torch.Tensor] | None = field(default=None, repr=False)

    @property
    def residency(self) -> tuple[bool, bool, bool]:
        """(parameters, gradient buffers, optimizer state) on the device; a built model that no
        :class:`~megarl.models.trainable.TrainableModel` wraps (the frozen reference) has no
        gradient buffers or optimizer."""
        return (self._host is None, False, False)

    @torch.no_grad()
    def place(self, *, params: bool, grads: bool = False, optimizer: bool = False) -> None:
        """Parameters on the device (True) or in host memory (False), as Megatron's buffers
        offload: a (pinned) host copy, the device storage freed (under CPU emulation too, so a
        pass that runs while they are away fails on CPU as it would on a GPU)."""
        del grads, optimizer  # none to move
        if params == (self._host is None):
            return
        unique = {id(p): p for chunk in self.chunks for p in chunk.parameters()}
        if not params:
            host = {}
            for key, p in unique.items():
                copy = p.detach().to("cpu", copy=True)
                host[key] = copy.pin_memory() if torch.cuda.is_available() else copy
                p.untyped_storage().resize_(0)
            self._host = host
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            return
        for key, p in unique.items():
            copy = self._host[key]
            p.untyped_storage().resize_(copy.numel() * copy.element_size())
            p.copy_(copy, non_blocking=True)
        self._host = None


def build_model(
    source: str | Path | ModelDims,
    layout: ParallelLayout,
    *,
    role: Role = "actor",
    dtype: torch.dtype = torch.float32,
    load_weights: bool = True,
    initialize: bool = True,
    transformer_impl: TransformerImpl = "auto",
    recompute: Recompute | None = None,
    value_head_seed: int = 0,
    fusions: Fusions | None = None,
    moe: MoeSettings | None = None,
    hf_weights: bool = True,
) -> BuiltModel:
    """Build this rank's chunks of a Llama/Qwen-family (dense, or Qwen3-MoE / Mixtral) actor or
    critic.

    Args:
        source: an HF checkpoint directory (config.json + safetensors) or a ``ModelDims``
            (random initialisation; nothing is loaded).
        layout: the parallel layout; must equal the initialised Megatron parallel state.
        role: ``actor`` (vocabulary output layer), ``critic`` (scalar value head, initialised
            from the checkpoint's ``score.weight`` when it has one, else seeded by
            ``value_head_seed``) or ``reward`` (a ``*ForSequenceClassification`` reward model:
            the same scalar head, which must come from the checkpoint's ``score.weight``).
        dtype: parameter dtype (float32 on CPU tests, bfloat16 on GPU).
        load_weights: copy the HF weights in (ignored for a ``ModelDims`` source).
        initialize: run Megatron's random initialisation when nothing is loaded (False: leave
            the parameters uninitialised, for a Megatron checkpoint loaded next).
        fusions: fused kernels and pipeline memory savings (default: on where the spec allows).
        moe: verl's ``moe_*`` knobs for a MoE model (dispatcher, aux loss, capacity).
        hf_weights: False: read only the config from ``source``; the weights are loaded next
            from a Megatron distributed checkpoint (``*.megatron.use_dist_checkpointing``:
            :func:`megarl.trainer.setup.build_role_model`), so nothing is loaded or initialised.
    """
    _check_parallel_state(layout)
    hf_path: Path | None = None
    if isinstance(source, ModelDims):
        dims = source
        load_weights = False
    else:
        hf_path = Path(source)
        hf_config = read_hf_config(hf_path)
        dims = ModelDims.from_hf_config(hf_config, tp_size=layout.tp)
    problems = shape_layout_problems(layout, dims.known())
    if problems:
        sizes = {"tp": f"TP={layout.tp}", "pp": f"PP={layout.pp}", "vpp": f"VPP={layout.vpp}"}
        raise ValueError(f"{dims.architecture}: {problems[0].describe(**sizes)}")
    recompute = recompute or Recompute()
    config = build_transformer_config(
        dims,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.virtual_pipeline_model_parallel_size,
        context_parallel_size=layout.cp,
        sequence_parallel=layout.sequence_parallel,
        params_dtype=dtype,
        recompute_granularity=recompute.granularity,
        recompute_method=recompute.method,
        recompute_num_layers=recompute.num_layers,
        recompute_modules=recompute.modules,
        transformer_impl=transformer_impl,
        fusions=fusions,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        moe=moe,
        pipeline_split=layout.pipeline_split(),
    )
    load_weights = load_weights and hf_weights
    if load_weights or not initialize or not hf_weights:
        config.perform_initialization = False  # every parameter is overwritten by a load
    chunks = build_gpt_chunks(
        dims,
        config,
        transformer_impl=transformer_impl,
        value_head=role != "actor",
        value_head_seed=value_head_seed,
    )
    if dims.is_moe:
        _mark_experts_expert_parallel(chunks)
    if load_weights:
        if role == "reward":
            _check_score_head(hf_path)  # type: ignore[arg-type]
        with torch.no_grad():
            load_hf_weights(chunks, hf_path, dims)  # type: ignore[arg-type]
    return BuiltModel(dims, list(chunks), config, layout, role, hf_path)


def _mark_experts_expert_parallel(chunks) -> None:
    """Megatron marks expert weights ``allreduce=False`` (gradients reduced over expert-DP, an
    optimizer of their own beside the dense one) at EP > 1 only. Marked at EP 1 too (where
    expert-DP is DP: the same reduction), the optimizer and its checkpoint have one structure
    at every EP — dense and experts, chained — so a checkpoint resumes at another EP."""
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if mm.is_expert_param(name):
                param.allreduce = False


def _check_score_head(hf_path: Path) -> None:
    """A reward model's head is learned: a checkpoint without one would score at random."""
    with HFCheckpointReader(hf_path) as reader:
        shape = tuple(reader.get(VALUE_HEAD_HF_NAME).shape) if VALUE_HEAD_HF_NAME in reader else ()
    if len(shape) != 2 or shape[0] != 1:
        raise ValueError(
            f"{hf_path}: {VALUE_HEAD_HF_NAME} is {shape or 'missing'}; a reward model must be an "
            "HF *ForSequenceClassification checkpoint with num_labels=1"
        )


def _check_parallel_state(layout: ParallelLayout) -> None:
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("Megatron parallel state is not initialised (call init_distributed)")
    have = (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1,
        parallel_state.get_context_parallel_world_size(),
        parallel_state.get_expert_model_parallel_world_size(),
        parallel_state.get_expert_tensor_parallel_world_size(),
    )
    want = (layout.tp, layout.pp, layout.vpp, layout.cp, layout.ep, layout.etp)
    if have != want:
        raise ValueError(
            f"layout TP×PP×VPP×CP×EP×ETP = {'×'.join(map(str, want))} differs from the "
            f"initialised Megatron parallel state {'×'.join(map(str, have))}"
        )
