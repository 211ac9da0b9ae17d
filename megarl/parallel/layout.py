"""The one description of a Megatron parallel layout, and the rule for which layouts are legal.

Data parallelism is not stored: it is what remains of the world after TP × PP × CP. MoE
layers regroup the same ranks (Megatron's expert grid): each PP stage's ranks split into expert
tensor parallelism (ETP, default TP) × expert parallelism (EP) × expert data parallelism, so the
world must also divide by ETP × EP × PP.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ParallelLayout:
    """Model-parallel grid sizes of one model (Megatron's names)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    sequence_parallel: bool = False
    expert_tensor_parallel_size: int | None = None
    """Tensor parallelism inside each expert (None: TP, Megatron's default)."""

    @property
    def tp(self) -> int:
        return self.tensor_model_parallel_size

    @property
    def pp(self) -> int:
        return self.pipeline_model_parallel_size

    @property
    def vpp(self) -> int:
        """Model chunks per pipeline rank (1 without the interleaved schedule)."""
        return self.virtual_pipeline_model_parallel_size or 1

    @property
    def cp(self) -> int:
        return self.context_parallel_size

    @property
    def ep(self) -> int:
        return self.expert_model_parallel_size

    @property
    def etp(self) -> int:
        """Expert tensor-parallel size (TP unless set)."""
        return self.expert_tensor_parallel_size or self.tp

    def model_parallel_size(self) -> int:
        """Ranks of one data-parallel replica: TP × PP × CP."""
        return self.tp * self.pp * self.cp

    def data_parallel_size(self, world_size: int) -> int:
        """Data-parallel replicas in a world of ``world_size`` ranks (ValueError if not whole)."""
        if world_size % self.model_parallel_size():
            raise ValueError(
                f"world size {world_size} is not divisible by tensor_model_parallel_size × "
                f"pipeline_model_parallel_size × context_parallel_size = "
                f"{self.tp}×{self.pp}×{self.cp}"
            )
        expert = self.etp * self.ep * self.pp
        if world_size % expert:
            raise ValueError(
                f"world size {world_size} is not divisible by expert_tensor_parallel_size × "
                f"expert_model_parallel_size × pipeline_model_parallel_size = "
                f"{self.etp}×{self.ep}×{self.pp}"
            )
        return world_size // self.model_parallel_size()

    def expert_data_parallel_size(self, world_size: int) -> int:
        """Ranks that hold the same experts (Megatron's expert-data-parallel group):
        ``world / (ETP · EP · PP)``."""
        return world_size // (self.etp * self.ep * self.pp)

    def world_size(self) -> int:
        """The smallest world that holds this layout: TP × PP × CP and ETP × EP × PP both divide
        it (expert parallelism runs across data-parallel replicas)."""
        dense, expert = self.tp * self.cp, self.etp * self.ep
        return dense * expert // math.gcd(dense, expert) * self.pp


# ---------------------------------------------------------------------------------------------
# The rule for legal layouts (Megatron-Core 0.16.1's own checks)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayoutProblem:
    """One way a layout breaks Megatron's rule for a model; ``text`` names sizes as ``{tp}``,
    ``{pp}``, ``{vpp}`` so that each caller can name them its own way (a config key, a flag)."""

    text: str
    defaults: tuple[tuple[str, str], ...] = ()
    """Names used where the caller gives none (the expert sizes, ``EP=2``)."""

    def describe(self, **names: str) -> str:
        """The message with the caller's names, e.g. ``describe(tp="--tp 3", pp=..., vpp=...)``."""
        return self.text.format(**{**dict(self.defaults), **names})


def layout_problems(
    layout: ParallelLayout,
    *,
    num_attention_heads: int | None = None,
    num_query_groups: int | None = None,
    num_layers: int | None = None,
    ffn_hidden_size: int | None = None,
    head_dim: int | None = None,
    num_experts: int | None = None,
    moe_ffn_hidden_size: int | None = None,
) -> list[LayoutProblem]:
    """What Megatron-Core 0.16.1 refuses when building this model at this layout (empty: legal).

    The rule, read in Megatron's sources: ``TransformerConfig`` requires attention heads
    divisible by TP and query groups (KV heads) a multiple or a divisor of TP; with TP above the
    query groups each rank holds one group (``transformer/attention.py``). The column-parallel
    ``linear_qkv`` splits (heads + 2·groups)·head_dim rows and the row-parallel ``linear_fc2``
    the FFN width, so both must divide by TP. Layers must split evenly over PP, and each stage's
    layers over VPP (``get_num_layers_to_build``). Model fields that are ``None`` (unknown, as in
    a partial shape) are not checked. Sizes below 1 are the caller's to refuse.

    MoE (``num_experts`` > 0): the experts split evenly over EP (``BaseMoELayer``) and each
    expert's intermediate width over ETP (its ``linear_fc1``/``linear_fc2``); a dense model
    (``num_experts`` 0) refuses EP > 1 and a set ETP. Messages name ``{ep}`` and ``{etp}``.
    """
    tp, pp, vpp = layout.tp, layout.pp, layout.vpp
    out: list[LayoutProblem] = []
    heads, groups = num_attention_heads, num_query_groups
    if heads is not None and heads % tp:
        out.append(LayoutProblem(f"{{tp}} does not divide num_attention_heads={heads}"))
    if groups is not None and groups % tp and tp % groups:
        out.append(
            LayoutProblem(
                f"{{tp}} is neither a divisor nor a multiple of num_key_value_heads={groups} "
                "(Megatron's query groups)"
            )
        )
    if (
        not out
        and heads is not None
        and groups is not None
        and head_dim is not None
        and ((heads + 2 * groups) * head_dim) % tp
    ):
        rows = (heads + 2 * groups) * head_dim
        out.append(
            LayoutProblem(
                f"{{tp}} does not divide the linear_qkv rows (num_attention_heads + 2 × "
                f"num_key_value_heads) × head_dim = ({heads} + 2 × {groups}) × {head_dim} = {rows}"
            )
        )
    if ffn_hidden_size is not None and ffn_hidden_size % tp:
        out.append(LayoutProblem(f"{{tp}} does not divide intermediate_size={ffn_hidden_size}"))
    out += _expert_problems(layout, num_experts, moe_ffn_hidden_size)
    if num_layers is not None and num_layers % (pp * vpp):
        sizes = "{pp} × {vpp} = " + str(pp * vpp) if vpp > 1 else "{pp}"
        out.append(LayoutProblem(f"num_hidden_layers={num_layers} is not divisible by {sizes}"))
    return out


def _expert_problems(
    layout: ParallelLayout, num_experts: int | None, moe_ffn_hidden_size: int | None
) -> list[LayoutProblem]:
    ep, etp = layout.ep, layout.etp
    names = (("ep", f"EP={ep}"), ("etp", f"ETP={etp}"))
    if num_experts is None:
        return []
    if num_experts == 0:
        set_etp = layout.expert_tensor_parallel_size not in (None, layout.tp)
        return [
            LayoutProblem(f"{{{key}}} but the model is dense", names)
            for key, bad in (("ep", ep > 1), ("etp", set_etp))
            if bad
        ]
    out = []
    if num_experts % ep:
        out.append(
            LayoutProblem(f"{{ep}} does not divide the model's {num_experts} experts", names)
        )
    if moe_ffn_hidden_size and moe_ffn_hidden_size % etp:
        text = f"{{etp}} does not divide the experts' intermediate size {moe_ffn_hidden_size}"
        out.append(LayoutProblem(text, names))
    return out


_SHAPE_KEYS = (
    "num_attention_heads",
    "num_query_groups",
    "num_layers",
    "ffn_hidden_size",
    "head_dim",
    "num_experts",
    "moe_ffn_hidden_size",
)


def shape_layout_problems(layout: ParallelLayout, shape: Mapping[str, Any]) -> list[LayoutProblem]:
    """:func:`layout_problems` for a model shape given by ``ModelDims`` field names (a partial
    shape dict, or ``ModelDims.known()``); missing fields are not checked."""
    return layout_problems(layout, **{key: shape.get(key) for key in _SHAPE_KEYS})
