"""``megarl convert`` for a MoE model (Mixtral) as a user runs it: HF -> Megatron at EP=2 with
``--verify``, back to HF at TP=2 (experts split by expert TP instead) bit for bit, and
impossible expert layouts refused in one line naming the sizes."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from megarl.models.tiny import make_tiny_model
from tests.models._convert_cli import ok, run_convert
from tests.models.test_convert import assert_bit_identical, max_diff, one_error_line, read_tensors


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("moe") / "mixtral", "mixtral", seed=4)


@pytest.mark.multirank
def test_mixtral_ep2_checkpoint_verifies_and_exports_bit_identical_at_tp2(mixtral: Path):
    ckpt, out = mixtral.parent / "mixtral-ep2", mixtral.parent / "mixtral-back"
    result = ok(
        run_convert(
            "hf-to-megatron", "--hf-path", str(mixtral), "--out", str(ckpt), "--ep", "2",
            "--verify",
        )
    )  # fmt: skip
    diff, verdict = max_diff(result)
    assert verdict == "OK" and diff < 1e-4, result.stdout
    ok(run_convert("megatron-to-hf", "--ckpt", str(ckpt), "--out", str(out), "--tp", "2"))
    assert_bit_identical(load_file(mixtral / "model.safetensors"), read_tensors(out))


def test_impossible_expert_layouts_are_one_line_errors(mixtral: Path, tmp_path: Path):
    result = run_convert(
        "hf-to-megatron", "--hf-path", str(mixtral), "--out", str(tmp_path / "x"), "--ep", "3"
    )
    assert result.returncode == 2
    one_error_line(result.stderr, "--ep 3 does not divide the model's 8 experts")
    result = run_convert(
        "hf-to-megatron", "--hf-path", str(mixtral), "--out", str(tmp_path / "x"),
        "--tp", "2", "--etp", "128",
    )  # fmt: skip
    assert result.returncode == 2
    one_error_line(result.stderr, "--etp 128 does not divide the experts' intermediate size 64")
    dense = make_tiny_model(tmp_path / "qwen2", "qwen2", num_layers=2)
    result = run_convert(
        "hf-to-megatron", "--hf-path", str(dense), "--out", str(tmp_path / "y"), "--ep", "2"
    )
    assert result.returncode == 2
    one_error_line(result.stderr, "--ep 2 but the model is dense")
