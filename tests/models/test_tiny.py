"""Tiny random HF checkpoints: load offline with transformers, tokenizer works, all randomised."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from megarl.models import hf_mapping as hm
from megarl.models.tiny import SPECIAL_TOKENS, build_tokenizer, make_tiny_model

REPO = Path(__file__).resolve().parents[2]
CASES = {
    "qwen2": {"family": "qwen2"},
    "llama-tied": {"family": "llama", "tie_word_embeddings": True},
    "qwen3": {"family": "qwen3"},
}
ARCH = {"qwen2": "Qwen2ForCausalLM", "llama-tied": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {k: make_tiny_model(root / k, num_layers=2, **kw) for k, kw in CASES.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_loads_with_transformers(tiny_dirs: dict[str, Path], case: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_dirs[case]
    model, info = AutoModelForCausalLM.from_pretrained(
        path, output_loading_info=True, local_files_only=True
    )
    assert type(model).__name__ == ARCH[case]
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert model.config.vocab_size == len(tok) == 1000
    assert model.get_input_embeddings().weight.shape == (1000, 128)
    cfg = model.config
    assert cfg.hidden_act == "silu" and cfg.attention_dropout == 0.0
    assert (cfg.eos_token_id, cfg.pad_token_id) == (tok.eos_token_id, tok.pad_token_id) == (0, 1)

    # loaded weights equal the file, and map to Megatron and back (HF's tied lm_head included)
    sd = model.state_dict()
    on_disk = load_file(path / "model.safetensors")
    assert all(torch.equal(sd[k], v) for k, v in on_disk.items())
    dims = hm.ModelDims.from_hf_config(cfg)
    assert dims == hm.ModelDims.from_hf_config(json.loads((path / "config.json").read_text()))
    back = hm.megatron_to_hf(hm.hf_to_megatron(sd, dims), dims)
    assert (
        all(torch.equal(back[k], v) for k, v in on_disk.items()) and back.keys() == on_disk.keys()
    )
    if case == "llama-tied":
        assert "lm_head.weight" not in on_disk
        assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)

    # next-token distributions: neither uniform nor one-hot
    ids = tok("what is 3 + 4 ? the answer is 7 . user assistant 12", return_tensors="pt").input_ids
    with torch.no_grad():
        probs = model(ids).logits[0].float().softmax(-1)
    entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
    assert 1.0 < entropy.mean().item() < math.log(1000) - 1.0, entropy
    assert probs.max().item() < 0.999


def test_generation_config(tiny_dirs: dict[str, Path]) -> None:
    from transformers import GenerationConfig

    gen = GenerationConfig.from_pretrained(tiny_dirs["qwen2"], local_files_only=True)
    assert (gen.eos_token_id, gen.bos_token_id, gen.pad_token_id) == (0, 0, 1)


def test_all_tensors_randomised(tiny_dirs: dict[str, Path]) -> None:
    for case, path in tiny_dirs.items():
        state = load_file(path / "model.safetensors")
        assert any(k.endswith(".bias") for k in state) == (case == "qwen2")
        assert any("q_norm" in k for k in state) == (case == "qwen3")
        for name, t in state.items():
            assert t.dtype == torch.float32
            assert t.unique().numel() > t.numel() // 2, name  # no constant / zero tensor
            if name.endswith("norm.weight"):
                assert 0.5 < t.mean().item() < 1.5 and not torch.all(t == 1), name
            elif name.endswith(".bias"):
                assert t.abs().mean().item() > 0.01, name


def test_tokenizer(tiny_dirs: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dirs["qwen3"], local_files_only=True)
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == (
        "<|endoftext|>",
        "<|pad|>",
        "<|endoftext|>",
    )
    for text in ["what is 3 + 4 ? the answer is 7 .", "Hello, wörld! 12345\n\tnew line", "x"]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert max(ids) < 1000 and ids[0] != tok.bos_token_id  # no automatic BOS
    assert len(tok.encode("what is 3 + 4 ?")) <= 8  # merges learned, not bytes
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 2 and ids[-1] == 3
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "what is 1 + 1 ?"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<|im_start|>user\nwhat is 1 + 1 ?<|im_end|>\n<|im_start|>assistant\n"
    # every id decodes (random models sample anything)
    assert isinstance(tok.decode(list(range(1000))), str)


def test_tokenizer_other_vocab_sizes() -> None:
    for v in (300, 2048):
        assert len(build_tokenizer(v)) == v
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(100)


def test_same_seed_bit_identical(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    again = make_tiny_model(tmp_path / "again", num_layers=2, **CASES["qwen2"])
    files = sorted(p.name for p in tiny_dirs["qwen2"].iterdir())
    assert files == sorted(p.name for p in again.iterdir())
    for name in files:
        assert (again / name).read_bytes() == (tiny_dirs["qwen2"] / name).read_bytes(), name
    other = make_tiny_model(tmp_path / "other", num_layers=2, seed=1, **CASES["qwen2"])
    a, b = load_file(again / "model.safetensors"), load_file(other / "model.safetensors")
    assert not any(torch.equal(a[k], b[k]) for k in a)


def test_bf16_and_shapes(tmp_path: Path) -> None:
    path = make_tiny_model(
        tmp_path / "m", "llama", num_layers=1, hidden_size=64, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, intermediate_size=96, vocab_size=512,
        dtype=torch.bfloat16,
    )  # fmt: skip
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16" and cfg["vocab_size"] == 512
    state = load_file(path / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in state.values())
    assert state["model.layers.0.self_attn.k_proj.weight"].shape == (32, 64)
    assert state["model.layers.0.mlp.down_proj.weight"].shape == (64, 96)


def test_cli(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location(
        "make_tiny_model", REPO / "tools/make_tiny_model.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = mod.main(["--family", "qwen3", "--out", str(tmp_path / "q3"), "--num-layers", "1",
                    "--tie-word-embeddings", "--seed", "3"])  # fmt: skip
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["tie_word_embeddings"]
    assert cfg["num_hidden_layers"] == 1
    # runs as a plain script (repo root not on sys.path)
    res = subprocess.run(
        [sys.executable, str(REPO / "tools/make_tiny_model.py"), "--help"],
        cwd=tmp_path, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert "--tie-word-embeddings" in res.stdout
