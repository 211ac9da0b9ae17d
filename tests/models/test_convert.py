"""HF <-> Megatron conversion CLIs: bit-identical round trips across layouts, logit verification,
corrupted checkpoints, one-line errors, the tools scripts.

Every conversion runs as its own process (as a user runs it); fixtures convert once and several
tests read the result. TP×PP > 1 runs start their worker processes themselves (gloo).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from megarl.commands import convert
from megarl.models import verify
from megarl.models.tiny import make_tiny_model
from tests.models._convert_cli import ok, run_convert

MAX_DIFF = re.compile(r"max \|Δlogit\| = (\S+) .*tolerance (\S+): (OK|MISMATCH)")


def max_diff(result: subprocess.CompletedProcess) -> tuple[float, str]:
    m = MAX_DIFF.search(result.stdout)
    assert m, result.stdout + result.stderr
    return float(m.group(1)), m.group(3)


def read_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(f, framework="pt") as handle:
            tensors.update({k: handle.get_tensor(k) for k in handle.keys()})  # noqa: SIM118
    return tensors


def assert_bit_identical(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]):
    assert sorted(actual) == sorted(expected)
    for name, want in expected.items():
        got = actual[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name


def one_error_line(stderr: str, *needles: str) -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert "Traceback" not in stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


# -- fixtures: tiny models and conversions shared by the tests ------------------------------
# (qwen2 and its TP=2 checkpoint qwen2_tp2 come from conftest.py: test_convert_failures.py
# reads them too)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("convert")


@pytest.fixture(scope="module")
def llama_tied(root: Path) -> Path:
    return make_tiny_model(root / "llama", "llama", tie_word_embeddings=True, seed=2)


@pytest.fixture(scope="module")
def qwen2_pp2_export(root: Path, qwen2_tp2) -> tuple[Path, subprocess.CompletedProcess]:
    """The TP 2 checkpoint loaded at PP 2 split unevenly (1 + 3 of the 4 layers, Megatron-LM's
    flag), exported and verified there (the tied Llama's PP 2 export below splits evenly)."""
    out = root / "qwen2-from-tp2-at-pp2"
    ckpt = qwen2_tp2[0]
    result = run_convert(
        "megatron-to-hf", "--ckpt", str(ckpt), "--out", str(out), "--pp", "2",
        "--decoder-first-pipeline-num-layers", "1", "--verify",
    )  # fmt: skip
    return out, ok(result)


@pytest.fixture(scope="module")
def llama_tp1(root: Path, llama_tied: Path) -> Path:
    ckpt = root / "llama-tp1"
    ok(
        run_convert(
            "--hf-path", str(llama_tied), "--out", str(ckpt), script="convert_hf_to_megatron.py"
        )
    )
    return ckpt


# -- round trips ---------------------------------------------------------------------------


def test_round_trip_tp1_via_tools_scripts_tied_llama(root: Path, llama_tied: Path, llama_tp1: Path):
    out = root / "llama-back"
    ok(run_convert("--ckpt", str(llama_tp1), "--out", str(out), script="convert_megatron_to_hf.py"))
    assert_bit_identical(load_file(llama_tied / "model.safetensors"), read_tensors(out))
    assert "lm_head.weight" not in read_tensors(out)
    # self-contained: config, tokenizer and generation files come from the checkpoint's own
    # copy (the --verify runs below load exported directories with transformers)
    for name in (
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert (out / name).is_file(), name
    assert json.loads((out / "config.json").read_text()) == json.loads(
        (llama_tied / "config.json").read_text()
    )


@pytest.mark.multirank
def test_round_trip_across_layouts_qwen2_tp2_to_pp2(qwen2: Path, qwen2_tp2, qwen2_pp2_export):
    ckpt, _ = qwen2_tp2
    out, _ = qwen2_pp2_export
    meta = json.loads((ckpt / "megarl_meta.json").read_text())
    assert meta["saved_layout"] == {"tp": 2, "pp": 1, "vpp": None, "ep": 1, "etp": None}
    assert meta["dtype"] == "float32" and meta["hf_config"]["vocab_size"] == 1100
    assert (ckpt / convert.HF_FILES_DIR / "tokenizer.json").is_file()
    assert len(list(out.glob("model-*-of-00002.safetensors"))) == 2
    assert "stage 0 holds 1 of 4 layers" in qwen2_pp2_export[1].stderr
    assert_bit_identical(load_file(qwen2 / "model.safetensors"), read_tensors(out))


@pytest.mark.multirank
def test_tied_llama_exported_at_pp2_in_bf16(root: Path, llama_tied: Path, llama_tp1: Path):
    """The tied output layer crosses pipeline stages; --dtype casts; --verify rounds the fp32
    checkpoint to bf16 like the export does, so it still passes."""
    out = root / "llama-pp2-bf16"
    result = ok(
        run_convert(
            "megatron-to-hf", "--ckpt", str(llama_tp1), "--out", str(out), "--pp", "2",
            "--dtype", "bf16", "--verify",
        )
    )  # fmt: skip
    expected = {
        k: v.to(torch.bfloat16) for k, v in load_file(llama_tied / "model.safetensors").items()
    }
    assert_bit_identical(expected, read_tensors(out))
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    diff, verdict = max_diff(result)
    assert verdict == "OK" and diff < 1e-4


# -- verification --------------------------------------------------------------------------


@pytest.mark.multirank
def test_verify_passes_and_prints_the_max_difference(qwen2_tp2, qwen2_pp2_export):
    for _, result in (qwen2_tp2, qwen2_pp2_export):
        diff, verdict = max_diff(result)
        assert verdict == "OK" and 0 <= diff < 1e-4, result.stdout


def swap_k_v(src: Path, dst: Path, layer: int) -> Path:
    """Copy of an HF directory with k_proj and v_proj (weights and biases) swapped in one layer."""
    shutil.copytree(src, dst)
    state = load_file(src / "model.safetensors")
    for kind in ("weight", "bias"):
        k, v = (f"model.layers.{layer}.self_attn.{p}_proj.{kind}" for p in "kv")
        state[k], state[v] = state[v], state[k]
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.multirank
def test_verify_fails_when_checkpoint_and_hf_weights_differ(root: Path, qwen2: Path, qwen2_tp2):
    """The TP=2 checkpoint of qwen2 against a copy of qwen2 with k and v swapped in one layer
    (what a mapping bug would write)."""
    corrupted_hf = swap_k_v(qwen2, root / "qwen2-kv-swapped", layer=2)
    result = run_convert("verify", "--ckpt", str(qwen2_tp2[0]), "--hf-path", str(corrupted_hf))
    assert result.returncode == 1, result.stdout + result.stderr
    diff, verdict = max_diff(result)
    assert verdict == "MISMATCH" and diff > 1e-2


# -- errors --------------------------------------------------------------------------------


def test_missing_path_and_unsupported_architecture_as_processes(root: Path, qwen2: Path):
    result = run_convert(
        "hf-to-megatron", "--hf-path", str(root / "nope"), "--out", str(root / "x")
    )
    assert result.returncode == 2
    one_error_line(result.stderr, str(root / "nope"), "does not exist")

    gpt2 = root / "gpt2"
    shutil.copytree(qwen2, gpt2)
    cfg = json.loads((gpt2 / "config.json").read_text())
    (gpt2 / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    result = run_convert("hf-to-megatron", "--hf-path", str(gpt2), "--out", str(root / "x"))
    assert result.returncode == 2
    one_error_line(result.stderr, "GPT2LMHeadModel", str(gpt2 / "config.json"))
    assert not (root / "x").exists()


UNEVEN_REFUSED = (
    "--decoder-first-pipeline-num-layers=4 leave 0 of num_hidden_layers=4 for 1 other stage of "
    "--pp 2; --decoder-first-pipeline-num-layers=1 works"
)


def test_input_errors_are_one_line(tmp_path: Path, qwen2: Path, llama_tp1: Path, capsys):
    ckpt = llama_tp1
    (tmp_path / "empty").mkdir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("x")
    cases = [
        (["hf-to-megatron", "--hf-path", str(tmp_path / "empty")], "has no config.json"),
        (["hf-to-megatron", "--hf-path", str(qwen2), "--tp", "3"], "--tp 3 does not divide"),
        (["hf-to-megatron", "--hf-path", str(qwen2), "--pp", "3"], "num_hidden_layers=4"),
        (["hf-to-megatron", "--hf-path", str(qwen2), "--pp", "2", "--vpp", "4"], "--vpp 4"),
        (
            [
                "hf-to-megatron",
                "--hf-path",
                str(qwen2),
                "--pp",
                "2",
                "--decoder-first-pipeline-num-layers",
                "4",
            ],
            UNEVEN_REFUSED,
        ),
        (["megatron-to-hf", "--ckpt", str(tmp_path / "nope")], "does not exist"),
        (["megatron-to-hf", "--ckpt", str(qwen2)], "not a Megatron distributed checkpoint"),
        (["megatron-to-hf", "--ckpt", str(ckpt), "--tp", "8"], "--tp 8"),
    ]
    for argv, needle in cases:
        code = convert.main([*argv, "--out", str(tmp_path / "out")])
        assert code == 2, argv
        one_error_line(capsys.readouterr().err, needle)
    assert (
        convert.main(["hf-to-megatron", "--hf-path", str(qwen2), "--out", str(tmp_path / "full")])
        == 2
    )
    one_error_line(capsys.readouterr().err, "is not empty", "--force")
    other = make_tiny_model(tmp_path / "other", "llama", num_layers=2, tie_word_embeddings=True)
    assert convert.main(["verify", "--ckpt", str(ckpt), "--hf-path", str(other)]) == 2
    one_error_line(capsys.readouterr().err, "different model", "num_layers")
    assert not (tmp_path / "out").exists()


def test_tools_scripts_help():
    for script, sub in (
        ("convert_hf_to_megatron.py", "--hf-path"),
        ("convert_megatron_to_hf.py", "--ckpt"),
    ):
        result = ok(run_convert("--help", script=script))
        assert sub in result.stdout and "--verify" in result.stdout


# -- pure helpers ---------------------------------------------------------------------------


def test_verify_inputs_are_seeded_and_of_different_lengths():
    a = verify.verify_inputs(1000, 4, 32, seed=0)
    b = verify.verify_inputs(1000, 4, 32, seed=0)
    assert [len(s) for s in a] == sorted({len(s) for s in a}, reverse=True)
    assert len(a[0]) == 32 and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert all(int(s.max()) < 1000 for s in a)


def test_safetensors_dtype_reads_the_header(tmp_path: Path):
    save_file(
        {"model.embed_tokens.weight": torch.zeros(2, 2, dtype=torch.bfloat16)},
        str(tmp_path / "a.safetensors"),
    )
    assert convert.safetensors_dtype(tmp_path) == "bfloat16"
