"""megarl's one statement of the pipeline's layer split (:func:`megarl.parallel.layout.
chunk_layer_range`) against Megatron-Core's own ``TransformerConfig`` checks,
``get_num_layers_to_build`` and ``get_transformer_layer_offset``, over every split field, PP 1-4,
VPP 1-2 and 2-8 layers; no processes (both functions take the stage as an argument)."""

from __future__ import annotations

import dataclasses
import itertools
import re

import pytest

from megarl.parallel.layout import (
    ParallelLayout,
    chunk_layer_counts,
    chunk_layer_range,
    layer_chunk,
    pipeline_split_problems,
)


def _splits():
    for first, last in itertools.product((None, 1, 2, 3, 4), repeat=2):
        yield {"num_layers_in_first_pipeline_stage": first,
               "num_layers_in_last_pipeline_stage": last}  # fmt: skip
    for embedding, loss in ((True, False), (False, True), (True, True)):
        yield {"account_for_embedding_in_pipeline_split": embedding,
               "account_for_loss_in_pipeline_split": loss}  # fmt: skip
    yield {"num_layers_in_first_pipeline_stage": 1, "account_for_loss_in_pipeline_split": True}


def _megatron(num_layers: int, pp: int, vpp: int | None, split: dict):
    """Megatron's config for this split, or None where its checks refuse it."""
    import torch
    from megatron.core.transformer import TransformerConfig

    try:
        return TransformerConfig(
            num_layers=num_layers, hidden_size=8, num_attention_heads=2,
            pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
            pipeline_dtype=torch.float32, use_cpu_initialization=True, **split,
        )  # fmt: skip
    except (ValueError, AssertionError):
        return None


def _megatron_ranges(config, pp: int, vpp: int | None) -> dict | None:
    """Each chunk's layers by Megatron's functions (None: they fail, as on a zero division)."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    out = {}
    for pp_rank, vp_stage in itertools.product(range(pp), range(vpp or 1)):
        stage = vp_stage if vpp else None
        try:
            count = get_num_layers_to_build(config, vp_stage=stage, pp_rank=pp_rank)
            offset = get_transformer_layer_offset(config, vp_stage=stage, pp_rank=pp_rank)
        except (ZeroDivisionError, AssertionError):
            return None
        out[pp_rank, vp_stage] = range(offset, offset + count)
    return out


def _suggestion_is_legal(layout: ParallelLayout, num_layers: int, message: str) -> bool:
    """The split a refusal names as working is legal: the even split, or one stage's size set
    (over the refused split's sizes, or over the even split); or, where it names none, even the
    even split and every first-stage size are refused."""
    even = ParallelLayout(1, layout.pp, layout.virtual_pipeline_model_parallel_size)
    if "the even split" in message:
        return not pipeline_split_problems(even, num_layers)
    if "no split of these layers" in message:
        return all(
            pipeline_split_problems(trial, num_layers)
            for trial in [even] + [dataclasses.replace(even, num_layers_in_first_pipeline_stage=n)
                                   for n in range(1, num_layers + 1)]
        )  # fmt: skip
    match = re.search(r"(num_layers_in_\w+_pipeline_stage)=(\d+) works$", message)
    assert match, message
    trials = [dataclasses.replace(base, **{match[1]: int(match[2])}) for base in (layout, even)]
    return any(not pipeline_split_problems(trial, num_layers) for trial in trials)


def _tiles(ranges: dict, num_layers: int) -> bool:
    """Every chunk holds a layer and together they hold each layer once (Megatron accepts both
    stages set at PP 1 and builds the last's count)."""
    layers = sorted(i for r in ranges.values() for i in r)
    return all(len(r) for r in ranges.values()) and layers == list(range(num_layers))


def test_split_equals_megatron():
    """Where Megatron accepts a split and builds every layer once in non-empty chunks, megarl
    accepts it and gives each chunk Megatron's layers; everywhere else megarl refuses it in one
    message that ends with a split that works (and that split is legal)."""
    checked = refused = 0
    for num_layers, pp, vpp in itertools.product(range(2, 9), (1, 2, 3, 4), (None, 2)):
        if vpp and pp == 1:
            continue  # refused before the split (VPP needs PP > 1)
        for split in _splits():
            layout = ParallelLayout(1, pp, vpp, **split)
            problems = pipeline_split_problems(layout, num_layers)
            config = _megatron(num_layers, pp, vpp, split)
            theirs = None if config is None else _megatron_ranges(config, pp, vpp)
            legal = theirs is not None and _tiles(theirs, num_layers)
            sizes = [split.get(f"num_layers_in_{end}_pipeline_stage") for end in ("first", "last")]
            if pp == 1 and None not in sizes:
                legal = False  # megarl's refusal: one stage, two sizes (Megatron takes the last)
            where = (num_layers, pp, vpp, split, [p.describe(pp="PP", vpp="VPP") for p in problems])
            assert legal == (not problems), where
            if not legal:
                refused += 1
                if layout.pipeline_split():
                    assert _suggestion_is_legal(layout, num_layers, where[-1][0]), where
                continue
            checked += 1
            ours = {
                (r, v): chunk_layer_range(layout, num_layers, r, v)
                for r, v in itertools.product(range(pp), range(layout.vpp))
            }
            assert ours == theirs, where
            assert sum(map(sum, chunk_layer_counts(layout, num_layers))) == num_layers
            for layer in range(num_layers):
                assert layer in ours[layer_chunk(layout, num_layers, layer)]
    assert checked > 150 and refused > 300, (checked, refused)


@pytest.mark.parametrize(
    "split, text",
    [
        ({"num_layers_in_first_pipeline_stage": 2}, ("stages of PP=3; num_layers_in_first_"
         "pipeline_stage=1 works")),
        ({"num_layers_in_first_pipeline_stage": 0}, "at least one layer"),
        ({"num_layers_in_first_pipeline_stage": 1, "account_for_embedding_in_pipeline_split":
          True}, "cannot be set with"),
        ({"account_for_embedding_in_pipeline_split": True,
          "account_for_loss_in_pipeline_split": True}, ("= 7 is not divisible by PP=3; "
         "num_layers_in_first_pipeline_stage=1 works")),
    ],
)  # fmt: skip
def test_refusals_name_a_split_that_works(split, text):
    """5 layers over PP 3: the message names the field and a value that works."""
    layout = ParallelLayout(1, 3, **split)
    (problem,) = pipeline_split_problems(layout, 5)
    assert text in problem.describe(pp="PP=3"), problem.describe(pp="PP=3")
