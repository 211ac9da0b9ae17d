"""Fixtures for the config tests: hermetic working directory and HF cache, tiny HF model dirs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _hermetic(hermetic):
    """Every test here is hermetic (tests/conftest.py)."""


@pytest.fixture
def hf_model(tmp_path):
    """Factory: a model directory holding only a minimal HF config.json (tiny-qwen2 shape)."""

    def make(name: str = "model", **fields) -> Path:
        config = {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_hidden_layers": 4,
            "hidden_size": 128,
            "vocab_size": 1000,
            "max_position_embeddings": 512,
        }
        config.update(fields)
        directory = tmp_path / name
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(json.dumps(config))
        return directory

    return make
