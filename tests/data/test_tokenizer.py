"""``trust_remote_code`` (issue 56): the actor's tokenizer is loaded with it when
``actor_rollout_ref.model.trust_remote_code`` or ``data.trust_remote_code`` is true, by the
trainer (:func:`megarl.data.tokenizer.load_actor_tokenizer`) and by ``megarl train``'s pre-flight
data check, so a checkpoint whose tokenizer is its own code (``auto_map``) gets that tokenizer;
without it transformers falls back to the built-in class. The model stays megarl's own build."""

from __future__ import annotations

import json
import shutil

import pytest

from megarl.config import load_config, validate
from tests.conftest import REPO

CUSTOM = '''
import os
from pathlib import Path

from transformers import PreTrainedTokenizerFast


class MarkedTokenizer(PreTrainedTokenizerFast):
    """The checkpoint's own tokenizer: marks each load in $MEGARL_TEST_TOKENIZER_LOADS."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        with open(os.environ["MEGARL_TEST_TOKENIZER_LOADS"], "a") as f:
            f.write("loaded\\n")
'''


@pytest.fixture
def custom_tokenizer_model(tiny_model_dir, tmp_path, monkeypatch):
    model = tmp_path / "custom-tokenizer"
    shutil.copytree(tiny_model_dir, model)
    (model / "custom_tok.py").write_text(CUSTOM)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": [None, "custom_tok.MarkedTokenizer"]}
    config["tokenizer_class"] = "MarkedTokenizer"
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    loads = tmp_path / "loads"
    monkeypatch.setenv("MEGARL_TEST_TOKENIZER_LOADS", str(loads))
    return model, loads


@pytest.mark.parametrize("key", ["actor_rollout_ref.model", "data", None])
def test_the_actor_tokenizer_is_the_checkpoints_own_code_only_when_trusted(
    custom_tokenizer_model, key
):
    from megarl.data.tokenizer import load_actor_tokenizer

    model, loads = custom_tokenizer_model
    overrides = [f"actor_rollout_ref.model.path={model}"]
    if key is not None:
        overrides.append(f"{key}.trust_remote_code=true")
    cfg = load_config(REPO / "configs" / "grpo_tiny_cpu.yaml", overrides)
    validate(cfg)  # accepted: the architecture is a built-in one
    tokenizer = load_actor_tokenizer(cfg)
    trusted = key is not None
    assert (type(tokenizer).__name__ == "MarkedTokenizer") == trusted
    assert loads.exists() == trusted
    assert tokenizer("hello").input_ids  # the same vocabulary either way


def test_the_preflight_data_check_loads_the_trusted_tokenizer(custom_tokenizer_model, tmp_path):
    from megarl.commands import data
    from megarl.commands.train import _check_data

    model, loads = custom_tokenizer_model
    assert data.main(["synth", "--out", str(tmp_path / "data"), "--train-size", "64"]) == 0
    cfg = load_config(REPO / "configs" / "grpo_tiny_cpu.yaml", [
        f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.model.trust_remote_code=true",
        f"data.train_files={tmp_path / 'data' / 'train.parquet'}",
        f"data.val_files={tmp_path / 'data' / 'test.parquet'}",
    ])  # fmt: skip
    assert _check_data(cfg) is None
    assert loads.exists()
