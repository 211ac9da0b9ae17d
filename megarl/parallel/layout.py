"""The one description of a Megatron parallel layout, and the rule for which layouts are legal.

Data parallelism is not stored: it is what remains of the world after TP × PP × CP. MoE
layers regroup the same ranks (Megatron's expert grid): each PP stage's ranks split into expert
tensor parallelism (ETP, default TP) × expert parallelism (EP) × expert data parallelism, so the
world must also divide by ETP × EP × PP.

The layers split over the pipeline as Megatron-Core 0.16.1 splits them: evenly, or unevenly by
its four split fields (a first and/or last stage of its own size, or the embedding and the loss
counted as one layer each). :func:`chunk_layer_range` is the one statement of that split.
"""

from __future__ import annotations

import dataclasses
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
    num_layers_in_first_pipeline_stage: int | None = None
    """Layers of pipeline stage 0 (None: its share of an even split)."""
    num_layers_in_last_pipeline_stage: int | None = None
    """Layers of the last pipeline stage (None: its share of an even split)."""
    account_for_embedding_in_pipeline_split: bool = False
    """The embedding counts as one layer of the split (stage 0 builds one layer fewer)."""
    account_for_loss_in_pipeline_split: bool = False
    """The output layer and loss count as one layer (the last stage builds one fewer)."""

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

    def pipeline_split(self) -> dict[str, Any]:
        """The split fields away from Megatron's defaults, by ``TransformerConfig`` name."""
        split = {
            "num_layers_in_first_pipeline_stage": self.num_layers_in_first_pipeline_stage,
            "num_layers_in_last_pipeline_stage": self.num_layers_in_last_pipeline_stage,
            "account_for_embedding_in_pipeline_split": self.account_for_embedding_in_pipeline_split,
            "account_for_loss_in_pipeline_split": self.account_for_loss_in_pipeline_split,
        }
        return {
            key: value for key, value in split.items() if value is not None and value is not False
        }

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
    the FFN width, so both must divide by TP. The layers must split over PP and VPP
    (:func:`pipeline_split_problems`). Model fields that are ``None`` (unknown, as in
    a partial shape) are not checked. Sizes below 1 are the caller's to refuse.

    MoE (``num_experts`` > 0): the experts split evenly over EP (``BaseMoELayer``) and each
    expert's intermediate width over ETP (its ``linear_fc1``/``linear_fc2``); a dense model
    (``num_experts`` 0) refuses EP > 1 and a set ETP. Messages name ``{ep}`` and ``{etp}``.
    """
    tp = layout.tp
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
    if num_layers is not None:
        out += pipeline_split_problems(layout, num_layers)
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


# ---------------------------------------------------------------------------------------------
# The pipeline's layer split (Megatron-Core 0.16.1: get_num_layers_to_build and
# get_transformer_layer_offset, which tests/parallel/test_pipeline_split.py checks it against)
# ---------------------------------------------------------------------------------------------

SPLIT_NAMES = (
    ("first", "num_layers_in_first_pipeline_stage"),
    ("last", "num_layers_in_last_pipeline_stage"),
    ("embedding", "account_for_embedding_in_pipeline_split"),
    ("loss", "account_for_loss_in_pipeline_split"),
)
"""The split fields' placeholders in :class:`LayoutProblem` texts, and their default names."""
PIPELINE_SPLIT_FIELDS = tuple(name for _, name in SPLIT_NAMES)
"""The four split fields, as ``ParallelLayout`` and ``TransformerConfig`` name them."""


def _stage_layers(layout: ParallelLayout, num_layers: int) -> list[int]:
    """Layers each pipeline stage's share holds (the embedding and loss counted, if so set)."""
    pp, first, last = (
        layout.pp,
        layout.num_layers_in_first_pipeline_stage,
        layout.num_layers_in_last_pipeline_stage,
    )
    if first is None and last is None:
        counted = num_layers + layout.account_for_embedding_in_pipeline_split
        counted += layout.account_for_loss_in_pipeline_split
        return [counted // pp] * pp
    middle_stages = pp - (first is not None) - (last is not None)
    middle = num_layers - (first or 0) - (last or 0)
    share = middle // middle_stages if middle_stages > 0 else 0
    stages = [share] * pp
    if first is not None:
        stages[0] = first
    if last is not None:
        stages[-1] = last
    return stages


def chunk_layer_counts(layout: ParallelLayout, num_layers: int) -> list[list[int]]:
    """Transformer layers built by each model chunk, ``[pp_rank][vp_stage]`` (the split's
    problems are :func:`pipeline_split_problems`'; a legal split gives every chunk one or more)."""
    vpp = layout.vpp
    counts = [[share // vpp] * vpp for share in _stage_layers(layout, num_layers)]
    if layout.account_for_embedding_in_pipeline_split:
        counts[0][0] -= 1
    if layout.account_for_loss_in_pipeline_split:
        counts[-1][-1] -= 1
    return counts


def chunk_layer_range(
    layout: ParallelLayout, num_layers: int, pp_rank: int, vp_stage: int
) -> range:
    """Global layer indices of model chunk ``vp_stage`` on stage ``pp_rank``.

    The layers run through the chunks in pipeline order, virtual stage by virtual stage (chunk
    ``(r, v)`` after every chunk of the virtual stages before ``v`` and chunks ``(0..r-1, v)``),
    each chunk holding its count of :func:`chunk_layer_counts`.
    """
    counts = chunk_layer_counts(layout, num_layers)
    start = sum(counts[r][v] for v in range(vp_stage) for r in range(layout.pp))
    start += sum(counts[r][vp_stage] for r in range(pp_rank))
    return range(start, start + counts[pp_rank][vp_stage])


def layer_chunk(layout: ParallelLayout, num_layers: int, layer: int) -> tuple[int, int]:
    """(pp_rank, vp_stage) whose chunk holds global layer ``layer`` (the order of
    :func:`chunk_layer_range`)."""
    counts = chunk_layer_counts(layout, num_layers)
    start = 0
    for vp_stage in range(layout.vpp):
        for pp_rank in range(layout.pp):
            start += counts[pp_rank][vp_stage]
            if 0 <= layer < start:
                return pp_rank, vp_stage
    raise ValueError(f"layer {layer} outside 0..{num_layers - 1}")


def pipeline_split_problems(layout: ParallelLayout, num_layers: int) -> list[LayoutProblem]:
    """What Megatron-Core 0.16.1's ``TransformerConfig`` refuses of this split (its uneven-PP
    checks), and what megarl cannot build: a chunk of no layers, or (Megatron divides by zero
    there) VPP with both the first and last stage set and no stage between. Each message names
    the fields as ``{first}``, ``{last}``, ``{embedding}``, ``{loss}``, ``{pp}``, ``{vpp}`` and
    ends with a split that works."""
    problem = _split_problem(layout, num_layers)
    if problem is None:
        return []
    if not layout.pipeline_split():
        return [LayoutProblem(problem)]  # Megatron's even split: the sizes are the problem
    return [LayoutProblem(f"{problem}; {_split_that_works(layout, num_layers)}", SPLIT_NAMES)]


def _split_problem(layout: ParallelLayout, num_layers: int) -> str | None:
    pp, vpp = layout.pp, layout.vpp
    first, last = (
        layout.num_layers_in_first_pipeline_stage,
        layout.num_layers_in_last_pipeline_stage,
    )
    embedding = layout.account_for_embedding_in_pipeline_split
    loss = layout.account_for_loss_in_pipeline_split
    sizes = "{pp} × {vpp} = " + str(pp * vpp) if vpp > 1 else "{pp}"
    for key, value, kind in (("first", first, int), ("last", last, int),
                             ("embedding", embedding, bool), ("loss", loss, bool)):  # fmt: skip
        if type(value) is not kind and not (kind is int and value is None):
            return f"{{{key}}}={value!r} is not {'an integer' if kind is int else 'a boolean'}"
    if first is None and last is None and not (embedding or loss):
        if num_layers % (pp * vpp):
            return f"num_hidden_layers={num_layers} is not divisible by {sizes}"
        return None
    if (first is not None or last is not None) and (embedding or loss):
        which = "{embedding}" if embedding else "{loss}"
        return f"{which}=true cannot be set with {{first}} / {{last}} (Megatron's rule)"
    for key, value in (("first", first), ("last", last)):
        if value is not None and value < 1:
            return f"{{{key}}}={value}: a stage holds at least one layer"
        if value is not None and value % vpp:
            return f"{{{key}}}={value} is not divisible by {{vpp}}"
    if first is not None or last is not None:
        middle_stages = pp - (first is not None) - (last is not None)
        middle = num_layers - (first or 0) - (last or 0)
        given = " and ".join(f"{{{k}}}={v}" for k, v in (("first", first), ("last", last)) if v)
        if middle_stages < 0 or bool(middle) != bool(middle_stages):
            others = f"{max(middle_stages, 0)} other stage{'s' * (middle_stages != 1)}"
            return (
                f"{given} leave {middle} of num_hidden_layers={num_layers} for {others} of {{pp}}"
            )
        if middle_stages and middle % (middle_stages * vpp):
            per = f"{middle_stages} × {{vpp}}" if vpp > 1 else str(middle_stages)
            return (f"the {middle} layers left by {given} do not divide over the "
                    f"{per} other stages of {{pp}}")  # fmt: skip
        if vpp > 1 and middle_stages == 0 and first is not None and last is not None:
            return ("{first} and {last} both set with {vpp} and no stage between (Megatron "
                    "divides by zero there)")  # fmt: skip
    else:
        counted = num_layers + embedding + loss
        if counted % (pp * vpp):
            return (f"num_hidden_layers={num_layers} + 1 for each of {{embedding}} / {{loss}} = "
                    f"{counted} is not divisible by {sizes}")  # fmt: skip
    counts = chunk_layer_counts(layout, num_layers)
    empty = [(r, v) for r in range(pp) for v in range(vpp) if counts[r][v] < 1]
    if empty:
        r, v = empty[0]
        where = f"stage {r}" + (f" chunk {v}" if vpp > 1 else "")
        return f"{where} would hold no layer (megarl builds none empty)"
    return None


def _split_that_works(layout: ParallelLayout, num_layers: int) -> str:
    """A legal split near ``layout``'s, by placeholders: its first (else last) stage's size
    changed, else the even split, else a first stage of its own size."""
    even = dataclasses.replace(
        layout,
        num_layers_in_first_pipeline_stage=None,
        num_layers_in_last_pipeline_stage=None,
        account_for_embedding_in_pipeline_split=False,
        account_for_loss_in_pipeline_split=False,
    )
    sizes_only = not (
        layout.account_for_embedding_in_pipeline_split or layout.account_for_loss_in_pipeline_split
    )
    key = "first" if layout.num_layers_in_first_pipeline_stage is not None else "last"
    if sizes_only and (size := _working_size(layout, key, num_layers)):
        return f"{{{key}}}={size} works"
    if _split_problem(even, num_layers) is None:
        return "the even split (the four split fields unset) works"
    if size := _working_size(even, "first", num_layers):
        return f"{{first}}={size} works"
    return "no split of these layers over {pp} works"


def _working_size(layout: ParallelLayout, key: str, num_layers: int) -> int | None:
    field = dict(SPLIT_NAMES)[key]
    for size in range(1, num_layers + 1):
        if _split_problem(dataclasses.replace(layout, **{field: size}), num_layers) is None:
            return size
    return None
