"""LoRA adapters on Megatron-Core's tensor-parallel linears (local and TE specs' dense linears,
and the local spec's MoE expert linears).

An adapter adds ``scaling · B(A(x))`` (``scaling = alpha / rank``) to a linear's output. It is
attached as an extra submodule ``<linear>.lora`` (parameters ``<linear>.lora.A`` ``[r, in]`` and
``<linear>.lora.B`` ``[out, r]``) plus a forward hook, so every base parameter keeps its name and
the code that walks base names (HF mapping, weight sync, conversion) is unchanged; it skips the
adapter names (:func:`is_adapter_param`).

Sharding follows the base weight, so that no activation of the base width is communicated:

- column-parallel (``linear_qkv``, ``linear_fc1``): A replicated, B split by output rows exactly
  as the base weight (the interleaved QKV groups, ``[gate shard; up shard]``: one B row per base
  row). The input is replicated, so ``h = A x`` is too; ``h`` passes through
  ``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce of its gradient), which
  makes A's gradient (and the input's) the sum over every rank's B shard.
- row-parallel (``linear_proj``, ``linear_fc2``): A split over TP by input columns (as the base
  weight), ``h = reduce_from_tensor_model_parallel_region(A_t x_t)`` (the all-reduce of an
  ``r``-wide activation), B replicated; the output is added after the base all-reduce.

With sequence parallelism (TP > 1) the activations outside the linears are split along the
sequence, and the adapter follows the base linear's communication at width ``r``:

- column-parallel: the input is the rank's sequence part ``[s/tp, b, in]``; ``h = A x`` of that
  part goes through ``gather_from_sequence_parallel_region`` (all-gather forward, reduce-scatter
  of its gradient) to ``[s, b, r]`` before the B shard. A's gradient then covers this rank's
  sequence part only: A is marked ``sequence_parallel`` so ``finalize_model_grads`` all-reduces it
  over TP (as Megatron does for the norms under sequence parallelism).
- row-parallel: the partial ``A_t x_t`` ``[s, b, r]`` goes through
  ``reduce_scatter_to_sequence_parallel_region`` to ``[s/tp, b, r]``, matching the base output's
  reduce-scatter; B (replicated) sees this rank's sequence part: marked ``sequence_parallel``.

Transformer Engine's spec fuses the norm into ``linear_qkv`` and ``linear_fc1``
(``TELayerNormColumnParallelLinear``), so the block's input is not the adapter's: the adapter
takes the norm's output, which TE returns beside the linear's once its documented
``return_layernorm_output`` is set (as Megatron-Bridge's LoRA does); the hook hands the caller the
usual ``(output, bias)``. TE's row- and column-parallel linears take their input as the local
spec's do.

Which linears get adapters: Megatron-Bridge's matcher over global module names
(:mod:`megarl.config.lora_modules`); with ``target_modules`` empty that includes the untied
``output_layer`` (vocab-parallel, a column-parallel linear: B split by vocabulary rows).

Initial values are drawn for the full (unsharded) tensors from a generator seeded by the seed and
the parameter's global name, then sliced: the same adapters at every TP×PP layout. Each init
method has Bridge's scale at TP 1 (``normal``: std 0.2; ``xavier``/``kaiming``: the fans of the
full ``[r, in]`` / ``[out, r]`` matrix); Bridge initialises each TP shard on its own, so its
scale moves with TP (docs/lora.md). B starts at zero (verl's ``lora_B_init_method=zero``), so
step 0 equals the base model. Adapters are created on their base weight's device.

MoE (local spec's ``SequentialMLP``, expert TP 1): every expert's ``linear_fc1`` and
``linear_fc2`` gets an adapter of its own, named and initialised by its global expert index, not
split; its factors are marked as Megatron marks the expert weights (``allreduce=False``: DDP
reduces them over the expert-data-parallel group; ``tensor_model_parallel``: the grad norm counts
them on every TP rank, whose peers hold other experts). Grouped-GEMM experts and expert TP > 1
are refused.

:func:`adapters_disabled` switches every adapter of some chunks off (the reference policy: the
base model, verl's ``ref_in_actor``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    set_tensor_model_parallel_attributes,
)

from megarl.config.lora_modules import (
    ADAPTABLE,
    DEFAULT_TARGETS,
    OUTPUT_LAYER,
    is_plain_name,
    is_targeted,
    pattern_error,
)
from megarl.models import hf_mapping as hm
from megarl.models import moe_mapping as mm
from megarl.models.gpt import (
    chunks_device,
    layer_offset,
    transformer_engine_import_error,
    unwrap,
)
from megarl.models.lora_shards import shard_adapter, sharded_state_dict_with_adapter

LORA_TARGETS = DEFAULT_TARGETS
"""verl's default ``target_modules``: the four linears of every layer."""

INIT_METHODS = ("xavier", "kaiming", "normal", "zero")
"""verl's (Megatron-Bridge's) ``lora_A_init_method`` / ``lora_B_init_method`` values."""

ADAPTER_MARK = ".lora."
"""Substring of every adapter parameter's name."""


class LoraError(ValueError):
    """An adapter setting megarl does not build, said in one line."""


@dataclass(frozen=True)
class LoraSettings:
    """What to attach: verl's ``actor_rollout_ref.model.lora.*`` in megarl's types."""

    rank: int
    """Adapter rank ``r`` (verl ``lora.rank``)."""
    alpha: float = 32.0
    """Scaling numerator: outputs are scaled by ``alpha / rank``."""
    dropout: float = 0.0
    """Dropout probability on the adapter path (training mode only)."""
    dropout_position: Literal["pre", "post"] = "pre"
    """``pre``: dropout on the adapter's input; ``post``: on its output (verl's names)."""
    target_modules: tuple[str, ...] = LORA_TARGETS
    """Linear names or full-name patterns that get adapters; empty: every linear (the output
    layer too) but ``exclude_modules`` (Bridge's matcher, :mod:`megarl.config.lora_modules`)."""
    exclude_modules: tuple[str, ...] = ()
    """Linear names or full-name patterns that do not (only with ``target_modules`` empty)."""
    a_init: str = "xavier"
    """Initialisation of A (:data:`INIT_METHODS`)."""
    b_init: str = "zero"
    """Initialisation of B; ``zero`` keeps step 0 equal to the base model."""
    seed: int = 0
    """Seed of the initial values (together with each parameter's global name)."""

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_config(cls, lora, *, seed: int = 0) -> LoraSettings:
        """From ``actor_rollout_ref.model.lora`` (:class:`megarl.config.schema.LoraConfig`);
        ``target_modules`` empty means every linear but ``exclude_modules`` (as verl)."""
        return cls(
            rank=int(lora.rank),
            alpha=float(lora.alpha),
            dropout=float(lora.dropout),
            dropout_position=lora.dropout_position,
            target_modules=tuple(lora.target_modules),
            exclude_modules=tuple(lora.exclude_modules),
            a_init=lora.lora_A_init_method,
            b_init=lora.lora_B_init_method,
            seed=seed,
        )

    def check(self) -> None:
        """Raise :class:`LoraError` naming the first setting that cannot be built."""
        if self.rank <= 0:
            raise LoraError(f"lora.rank must be > 0 to attach adapters, not {self.rank}")
        if self.alpha == 0:
            raise LoraError("lora.alpha=0 scales every adapter's output by 0: nothing can train")
        for key, entries in (("target_modules", self.target_modules),
                             ("exclude_modules", self.exclude_modules)):  # fmt: skip
            bad = [t for t in entries if is_plain_name(t) and t not in ADAPTABLE]
            if bad:
                raise LoraError(
                    f"lora.{key} {bad} are not Megatron linears megarl adapts (choose from "
                    f"{list(ADAPTABLE)}, or full-name patterns such as '*.layers.0.*')"
                )
            for t in entries:
                if (why := pattern_error(t)) is not None:
                    raise LoraError(f"lora.{key} entry {t!r} is no valid pattern: {why}")
        for what, method in (
            ("lora_A_init_method", self.a_init),
            ("lora_B_init_method", self.b_init),
        ):
            if method not in INIT_METHODS:
                raise LoraError(f"lora.{what}={method!r}: choose from {list(INIT_METHODS)}")
        if self.dropout_position not in ("pre", "post"):
            raise LoraError(
                f"lora.dropout_position must be pre or post, not {self.dropout_position!r}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise LoraError(f"lora.dropout must be in [0, 1), not {self.dropout}")


def is_adapter_param(name: str) -> bool:
    """Whether a (local or global) parameter name is an adapter's."""
    return ADAPTER_MARK in f".{name}"


def _init_full(
    method: str, shape: tuple[int, int], fan_in: int, fan_out: int, seed: int, name: str
):
    """The full initial tensor of one adapter parameter, the same on every rank and layout."""
    if method == "zero":
        return torch.zeros(shape)
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    if method == "xavier":  # xavier_normal_ on the [fan_out, fan_in] matrix
        std = math.sqrt(2.0 / (fan_in + fan_out))
    elif method == "kaiming":  # kaiming_uniform_(a=sqrt(5)), nn.Linear's default
        bound = 1.0 / math.sqrt(fan_in)
        return (torch.rand(shape, generator=g) * 2 - 1) * bound
    else:  # normal: Bridge's init_method_normal(0.2)
        std = 0.2
    return torch.randn(shape, generator=g) * std


class LoraAdapter(torch.nn.Module):
    """The adapter of one parallel linear: ``A`` ``[r, in_local]``, ``B`` ``[out_local, r]``.

    ``parallel`` is ``column`` or ``row`` (the base linear's kind); :meth:`forward` maps the base
    linear's input to the addend of its output.
    """

    def __init__(
        self,
        parallel: Literal["column", "row"],
        a: torch.Tensor,
        b: torch.Tensor,
        settings: LoraSettings,
        *,
        tp_size: int,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.tp_size = tp_size
        """Ranks splitting the base linear (expert linears: expert TP, which must be 1)."""
        self.sequence_parallel = sequence_parallel and tp_size > 1
        """The base linear runs Megatron's sequence parallelism (its input or output is split
        along the sequence over TP)."""
        self.scaling = settings.scaling
        self.dropout = settings.dropout
        self.dropout_position = settings.dropout_position
        self.enabled = True
        self.A = torch.nn.Parameter(a)
        self.B = torch.nn.Parameter(b)
        # Megatron's attributes: which parameters are TP shards (grad norm counts each once).
        if parallel == "column":
            set_tensor_model_parallel_attributes(self.A, False, 0, 1)
            set_tensor_model_parallel_attributes(self.B, tp_size > 1, 0, 1)
        else:
            set_tensor_model_parallel_attributes(self.A, tp_size > 1, 1, 1)
            set_tensor_model_parallel_attributes(self.B, False, 0, 1)
        if self.sequence_parallel:  # the replicated factor's gradient: this sequence part's
            replicated = self.A if parallel == "column" else self.B
            replicated.sequence_parallel = True  # summed over TP by finalize_model_grads

    def _drop(self, x: torch.Tensor, *, sharded: bool) -> torch.Tensor:
        if not (self.training and self.dropout > 0):
            return x
        if sharded:  # a TP-sharded activation: each rank its own mask (Megatron's TP RNG)
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return torch.nn.functional.dropout(x, self.dropout, True)
        return torch.nn.functional.dropout(x, self.dropout, True)  # same mask on every TP rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.A.dtype)
        sp = self.sequence_parallel  # then the column input and the row output are TP-sharded
        if self.dropout_position == "pre":
            x = self._drop(x, sharded=self.parallel == "row" or sp)
        h = torch.nn.functional.linear(x, self.A)
        if self.tp_size == 1:  # TP 1, or an expert linear (expert TP 1): nothing to communicate
            pass
        elif self.parallel == "column" and sp:
            h = tensor_parallel.gather_from_sequence_parallel_region(h)
        elif self.parallel == "column":
            h = tensor_parallel.copy_to_tensor_model_parallel_region(h)
        elif sp:
            h = tensor_parallel.reduce_scatter_to_sequence_parallel_region(h)
        else:
            h = tensor_parallel.reduce_from_tensor_model_parallel_region(h)
        y = torch.nn.functional.linear(h, self.B) * self.scaling
        if self.dropout_position == "post":
            y = self._drop(y, sharded=self.parallel == "column" or sp)
        return y


def _add_adapter_output(module: torch.nn.Module, args: tuple, output, *, norm_fused=False):
    """Forward hook of an adapted linear: its output plus the adapter's (when enabled), as the
    ``(output, bias)`` pair Megatron's callers take. ``norm_fused``: Transformer Engine's fused
    norm + linear, asked for its norm's output (the adapter's input; :func:`_norm_output`)."""
    if norm_fused:
        out, bias, x = _norm_output(output)
    else:
        (out, bias), x = output, args[0]
    if module.lora.enabled:
        out = out + module.lora(x).to(out.dtype)
    return out, bias


def _norm_output(output: tuple) -> tuple:
    """``(out, bias, norm output)`` of Megatron's ``TELayerNormColumnParallelLinear`` once TE's
    ``return_layernorm_output`` is set: TE's ``LayerNormLinear`` then returns ``(out, ln_out)``,
    or ``(out, bias, ln_out)`` with ``return_bias``, and Megatron's wrapper passes the latter on
    and pairs the former with ``None``. ``ln_out`` is this rank's sequence part under sequence
    parallelism (``return_layernorm_output_gathered`` stays off), as the local spec's input."""
    if len(output) == 3:
        return output
    (out, ln_out), bias = output
    return out, bias, ln_out


def _targeted_linears(model, offset: int, settings: LoraSettings) -> list[tuple[str, str, object]]:
    """(local path, global weight name, linear) of the model's tensor-parallel linears the
    settings select (Bridge's matcher over global module names); refuses a tied output layer."""
    out = []
    for path, module in model.named_modules():
        if not _is_parallel_linear(module):
            continue
        name = _global_name(path, offset, model.config)
        if not is_targeted(name.removesuffix(".weight"), settings.target_modules,
                           settings.exclude_modules):  # fmt: skip
            continue
        if path == OUTPUT_LAYER and model.share_embeddings_and_output_weights:
            raise LoraError(
                "LoRA on output_layer of a model with tied embeddings (tie_word_embeddings=true) "
                "is not built: add output_layer to actor_rollout_ref.model.lora.exclude_modules"
            )
        out.append((path, name, module))
    return out


def _is_parallel_linear(module: torch.nn.Module) -> bool:
    """Megatron's column- or row-parallel linear (local spec), or TE's (TE spec)."""
    if isinstance(module, ColumnParallelLinear | RowParallelLinear):
        return True
    te_norm_linear, te_linear = _te_linear_types()
    return isinstance(module, te_norm_linear | te_linear) and getattr(
        module, "parallel_mode", None
    ) in ("column", "row")


def _check_experts(config) -> None:
    """Refuse, in one line each, the MoE expert layouts adapters are not built for."""
    if not config.num_moe_experts:
        return
    if config.moe_grouped_gemm:
        raise LoraError(
            "LoRA on grouped-GEMM experts (Transformer Engine's MoE spec) is not built: set "
            "actor_rollout_ref.actor.megatron.transformer_impl=local (SequentialMLP experts)"
        )
    if parallel_state.get_expert_tensor_parallel_world_size() > 1:
        raise LoraError(
            "LoRA on MoE experts split over expert TP is not built: set "
            "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1"
        )


def _global_name(path: str, offset: int, config) -> str:
    """Global Megatron name of ``path``'s weight: global layer and (experts) expert index."""
    name = hm.megatron_name_to_global(f"{path}.weight", offset)
    if config.num_moe_experts and mm.is_expert_param(name):
        local = config.num_moe_experts // parallel_state.get_expert_model_parallel_world_size()
        name = mm.expert_name_to_global(
            name, parallel_state.get_expert_model_parallel_rank(), local
        )
    return name


def attach_adapters(chunks: Sequence[torch.nn.Module], settings: LoraSettings) -> int:
    """Attach an adapter to every targeted linear of this rank's chunks; returns how many.

    Base parameters stay as they are (the caller freezes them: :func:`freeze_base`). Under
    sequence parallelism each adapter follows its linear's (module docstring). On MoE models
    the expert linears of the local spec's ``SequentialMLP`` get adapters too (expert TP 1: not
    split; their parameters marked expert-parallel, as the base's, so that DDP reduces them over
    the expert-data-parallel group), initialised from their global expert index; grouped-GEMM
    experts and expert TP > 1 are refused in one line.
    """
    settings.check()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    count = 0
    for chunk in chunks:
        model = unwrap(chunk)
        _check_experts(model.config)
        offset = layer_offset(model.config, model.vp_stage)
        for path, global_name, linear in _targeted_linears(model, offset, settings):
            expert = mm.is_expert_param(global_name)
            dtype, device = linear.weight.dtype, linear.weight.device
            kind, in_f, out_f, norm_fused = _linear_kind(linear, path)
            a = _init_full(settings.a_init, (settings.rank, in_f), in_f, settings.rank,
                           settings.seed, global_name + ".A")  # fmt: skip
            b = _init_full(settings.b_init, (out_f, settings.rank), settings.rank, out_f,
                           settings.seed, global_name + ".B")  # fmt: skip
            split = 1 if expert else tp_size
            a, b = shard_adapter(kind, global_name, a, b, split, tp_rank)
            sp = bool(getattr(linear, "sequence_parallel", False)) and not expert
            a, b = (t.to(device=device, dtype=dtype).contiguous() for t in (a, b))
            linear.lora = LoraAdapter(kind, a, b, settings, tp_size=split,
                                      sequence_parallel=sp)  # fmt: skip
            if expert:  # reduced over the expert data-parallel group, as the expert weights
                for p in (linear.lora.A, linear.lora.B):
                    p.allreduce = False
                    # Not a TP duplicate (TP peers hold other experts at EP > 1): Megatron's grad
                    # norm then counts it on every TP rank, as the expert weights (so marked).
                    p.tensor_model_parallel = True
            if norm_fused:  # the adapter's input is the fused norm's output: TE returns it
                linear.return_layernorm_output = True
            linear.register_forward_hook(
                functools.partial(_add_adapter_output, norm_fused=norm_fused)
            )
            fc1 = kind == "column" and path.endswith("linear_fc1")
            linear.sharded_state_dict = types.MethodType(
                functools.partial(sharded_state_dict_with_adapter, fc1=fc1), linear
            )
            count += 1
    return count


def _linear_kind(linear: torch.nn.Module, path: str) -> tuple[str, int, int, bool]:
    """(``column`` or ``row``, full input size, full output size, fused norm) of a linear of the
    local spec (Megatron's parallel linears) or of Transformer Engine's spec (Megatron's
    ``TEColumnParallelLinear`` / ``TERowParallelLinear`` / ``TELayerNormColumnParallelLinear``,
    whose ``parallel_mode`` says the split and whose ``tp_size`` how many ranks share it)."""
    if isinstance(linear, ColumnParallelLinear | RowParallelLinear):
        kind = "column" if isinstance(linear, ColumnParallelLinear) else "row"
        return kind, linear.input_size, linear.output_size, False
    te_norm_linear, te_linear = _te_linear_types()
    if isinstance(linear, te_norm_linear | te_linear) and linear.parallel_mode in ("column", "row"):
        out_local, in_local = linear.weight.shape
        column = linear.parallel_mode == "column"
        in_f = in_local if column else in_local * linear.tp_size
        out_f = out_local * linear.tp_size if column else out_local
        return linear.parallel_mode, in_f, out_f, isinstance(linear, te_norm_linear)
    raise LoraError(
        f"LoRA on {type(linear).__name__} ({path}) is not built: adapters attach to Megatron's "
        "tensor-parallel linears (local spec) and Transformer Engine's (TE spec)"
    )


@functools.cache
def _te_linear_types() -> tuple[type, type]:
    """Megatron's TE fused norm + linear class and TE's linear base class; where Transformer
    Engine does not import (CPU), a class no module is an instance of."""
    if transformer_engine_import_error() is not None:
        absent = type("NoTransformerEngine", (), {})
        return absent, absent
    import transformer_engine.pytorch as te

    return te.LayerNormLinear, te.Linear


def adapted_linears(
    chunks: Sequence[torch.nn.Module],
) -> Iterator[tuple[int, str, torch.nn.Module]]:
    """(chunk index, global base weight name, linear) of every adapted linear of this rank."""
    for i, chunk in enumerate(chunks):
        model = unwrap(chunk)
        offset = layer_offset(model.config, model.vp_stage)
        for path, module in model.named_modules():
            if isinstance(getattr(module, "lora", None), LoraAdapter):
                yield i, _global_name(path, offset, model.config), module


def has_adapters(chunks: Sequence[torch.nn.Module]) -> bool:
    return any(True for _ in adapted_linears(chunks))


def any_rank_has_adapters(chunks: Sequence[torch.nn.Module]) -> bool:
    """Whether some rank's chunks hold adapters (collective over the default group): one answer
    for every rank, also where ``exclude_modules`` left a pipeline stage without any."""
    flag = torch.tensor([float(has_adapters(chunks))], device=chunks_device(chunks))
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())


def adapter_parameters(chunks: Sequence[torch.nn.Module]) -> list[torch.nn.Parameter]:
    return [p for _, _, lin in adapted_linears(chunks) for p in (lin.lora.A, lin.lora.B)]


def freeze_base(chunks: Sequence[torch.nn.Module]) -> None:
    """Every parameter but the adapters' stops requiring gradients (no grads, no optimizer
    state for them: Megatron's DDP and optimizer only take parameters that require grads)."""
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            p.requires_grad_(is_adapter_param(name))


@contextlib.contextmanager
def adapters_disabled(chunks: Sequence[torch.nn.Module]) -> Iterator[None]:
    """Run ``chunks`` as the base model (every adapter off) inside the block."""
    linears = [lin for _, _, lin in adapted_linears(chunks)]
    before = [lin.lora.enabled for lin in linears]
    for lin in linears:
        lin.lora.enabled = False
    try:
        yield
    finally:
        for lin, was in zip(linears, before, strict=True):
            lin.lora.enabled = was


@torch.no_grad()
def merged_weights(chunks: Sequence[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """{global base weight name: this rank's shard of ``W + scaling · B A``} of every enabled
    adapter (both sharded factors give the merged shard: column ``B_t A``, row ``B A_t``);
    computed in fp32, returned in the weight's dtype (what ``lora.merge=true`` syncs)."""
    out = {}
    for _, name, linear in adapted_linears(chunks):
        lora = linear.lora
        if not lora.enabled:
            continue
        delta = (lora.B.float() @ lora.A.float()) * lora.scaling
        out[name] = (linear.weight.float() + delta).to(linear.weight.dtype)
    return out


class AdaptersOff(torch.nn.Module):
    """One model chunk run with every adapter off: the base model (the reference policy when
    LoRA is on, verl's ``ref_in_actor``). Holds the chunk as ``module``, so Megatron's schedule
    (``set_input_tensor``) and megarl's ``unwrap`` reach the model through it."""

    def __init__(self, chunk: torch.nn.Module) -> None:
        super().__init__()
        self.module = chunk

    def forward(self, *args, **kwargs):
        with adapters_disabled([self.module]):
            return self.module(*args, **kwargs)


class BaseModelView:
    """The actor's chunks seen as the base model: what :class:`~megarl.models.build.BuiltModel`
    offers the reference passes (``chunks``, ``pack``, ``dims``), with no parameters of its own.
    Its residency is the actor's (the planner declares no separate reference model)."""

    shares_actor = True

    def __init__(self, actor) -> None:
        self.actor = actor
        self.chunks = [AdaptersOff(c) for c in actor.chunks]

    @property
    def pack(self) -> bool:
        return self.actor.pack

    @property
    def dims(self):
        return self.actor.model.dims
