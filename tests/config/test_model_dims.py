"""The one model-shape type: one HF-config reader, one parser, the partial form, and the
architecture section converting into it."""

from __future__ import annotations

import json

import pytest

from megarl.config import ArchitectureConfig, ModelDims, known_dims, read_hf_config
from megarl.config.model_source import architecture_dims

QWEN = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}


def test_one_reader_takes_a_directory_or_the_file_and_keeps_it_unchanged(tmp_path):
    data = {**QWEN, "text_config": {"unused": 1}, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(data))
    assert read_hf_config(tmp_path) == read_hf_config(tmp_path / "config.json") == data
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nope")):
        read_hf_config(tmp_path / "nope")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_hf_config(tmp_path / "bad")


def test_partial_and_complete_forms_share_one_parser():
    dims = ModelDims.from_hf_config(QWEN, tp_size=2)
    known = known_dims(QWEN)
    full = dims.known()
    assert all(full[name] == value for name, value in known.items())  # same names, same values
    assert set(full) - set(known) >= {"padded_vocab_size", "qkv_bias", "rope_theta"}
    assert (dims.num_query_groups, dims.head_dim, dims.ffn_hidden_size) == (2, 32, 256)
    partial = known_dims({"num_attention_heads": 6, "num_hidden_layers": 3})
    assert partial == {
        "num_attention_heads": 6,
        "num_query_groups": 6,  # HF's default: as many KV heads as query heads
        "num_layers": 3,
        "num_experts": 0,
    }


def test_multimodal_configs_are_read_through_their_text_part():
    vl = {
        "architectures": ["X"],
        "text_config": {k: v for k, v in QWEN.items() if k != "architectures"},
    }
    assert known_dims(vl)["num_attention_heads"] == 4


def test_missing_keys_are_named():
    with pytest.raises(ValueError, match="intermediate_size"):
        ModelDims.from_hf_config({k: v for k, v in QWEN.items() if k != "intermediate_size"})


def test_a_complete_architecture_section_is_a_model_dims():
    arch = ArchitectureConfig(
        architecture="Qwen2ForCausalLM",
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=4,
        hidden_size=128,
        intermediate_size=256,
        vocab_size=1000,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    known = architecture_dims(arch)
    assert known == {k: v for k, v in ModelDims.from_hf_config(QWEN).known().items() if k in known}
    assert known["architecture"] == "Qwen2ForCausalLM" and known["ffn_hidden_size"] == 256
    # a partial section leaves unknown fields out (KV heads are not assumed equal to heads)
    assert "num_query_groups" not in architecture_dims(ArchitectureConfig(num_attention_heads=8))


def test_a_sequence_classifier_has_its_backbones_dims():
    causal = ModelDims.from_hf_config(QWEN)
    rm = ModelDims.from_hf_config({**QWEN, "architectures": ["Qwen2ForSequenceClassification"]})
    assert rm.architecture == "Qwen2ForSequenceClassification" and rm.qkv_bias
    assert {**vars(rm), "architecture": ""} == {**vars(causal), "architecture": ""}
    with pytest.raises(ValueError, match="Qwen3ForSequenceClassification"):
        ModelDims.from_hf_config({**QWEN, "architectures": ["Qwen3ForSequenceClassification"]})
