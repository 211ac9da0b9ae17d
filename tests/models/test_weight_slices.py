"""A training rank reads only its TP shard's slices of the HF checkpoint
(``megarl.models.weights.read_tp_shard``): the same shard as building the full Megatron
parameter and splitting it, from about 1/TP of the bytes. No processes: the TP rank is an
argument."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megarl.config.model_dims import ModelDims, read_hf_config
from megarl.models import hf_mapping as hm
from megarl.models import moe_mapping as mm
from megarl.models.tiny import make_tiny_model
from megarl.models.weights import HFCheckpointReader, read_tp_shard

FAMILIES = {
    "qwen2": {"num_key_value_heads": 2},  # q/k/v biases
    "llama_tied_kv1": {"num_key_value_heads": 1, "tie_word_embeddings": True},
    "qwen3": {"num_key_value_heads": 2, "vocab_size": 1001},  # q/k norms, padded vocabulary
    "qwen2_moe": {"num_key_value_heads": 2},  # experts, a gated shared expert
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("slices")
    out = {}
    for name, kwargs in FAMILIES.items():
        family = name.split("_tied")[0]
        out[name] = make_tiny_model(root / name, family, num_layers=2, seed=3, **kwargs)
    return out


def _names(dims: ModelDims) -> list[str]:
    names = hm.megatron_param_names(dims, include_tied_output=True)
    if dims.is_moe:
        names += [n for n in hm.megatron_param_names(dims) if mm.is_expert_param(n)]
    return list(dict.fromkeys(names))


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("tp", [2, 4])
def test_each_shard_equals_the_split_of_the_full_parameter(models, family, tp):
    """Every parameter at every TP rank (TP 2 and 4; with one KV group TP 2 and 4 exceed it and
    linear_qkv is read whole), the vocabulary padded for that TP."""
    dims = ModelDims.from_hf_config(read_hf_config(models[family]), tp_size=tp)
    with HFCheckpointReader(models[family]) as reader:
        for name in _names(dims):
            full = hm.hf_to_megatron_param(name, reader.get, dims)
            for rank in range(tp):
                shard = read_tp_shard(reader, name, dims, tp, rank)
                assert torch.equal(shard, hm.tp_split(name, full, tp, rank, dims)), (name, rank)


def test_a_tp_rank_reads_about_its_share_of_the_bytes(models):
    """Qwen2 tiny at TP 2: each rank reads its half of every split tensor (of the vocabulary
    padded to 1024, rows 0-511 or 512-999) and the norms whole: the two ranks together read the
    checkpoint once plus the norms twice (each read it all before)."""
    path = models["qwen2"]
    dims = ModelDims.from_hf_config(read_hf_config(path), tp_size=2)
    with HFCheckpointReader(path) as reader:
        total = sum(reader.get(n).numel() * reader.get(n).element_size() for n in reader.names())
        replicated = sum(
            reader.get(n).numel() * reader.get(n).element_size()
            for n in reader.names()
            if n.endswith("norm.weight")
        )
    per_rank = []
    for rank in range(2):
        with HFCheckpointReader(path) as reader:
            for name in _names(dims):
                read_tp_shard(reader, name, dims, 2, rank)
            per_rank.append(reader.bytes_read)
    assert sum(per_rank) == total + replicated
    assert max(per_rank) < 0.52 * total  # rank 0: 512 of the 1000 vocabulary rows, rank 1: 488
