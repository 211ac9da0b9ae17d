"""``make venv-gpu`` from a wheelhouse, and its preflight checks (tools/gpu_preflight.py).

The GPU environment itself is gigabytes of CUDA wheels; here the target's own install steps run
with small wheels in their place (the step variables ``GPU_TORCH``, ``GPU_STACK``, ``GPU_TE``,
``GPU_CHECK_NO_GPU``), against a dead index, a decoy find-links and a pip configuration file of
the machine's, to show that with ``WHEELHOUSE`` pip reads that folder and nothing else. The real
wheelhouse was built and installed by hand (docs/install.md gives its size and time).
"""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PREFLIGHT = REPO / "tools" / "gpu_preflight.py"
sys.path.insert(0, str(REPO / "tools"))

import gpu_preflight  # tools/ is not a package: found through sys.path above


def make_wheel(folder: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> Path:
    """A pure-Python wheel of module ``name`` whose ``VERSION`` is ``version``."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": f"VERSION = {version!r}\n",
        f"{dist}/METADATA": "Metadata-Version: 2.1\n"
        f"Name: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires),
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{path},sha256={digest.decode()},{len(text.encode())}")
    files[f"{dist}/RECORD"] = "\n".join([*record, f"{dist}/RECORD,,"]) + "\n"
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
    return wheel


def run_make(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "--no-print-directory", *args], cwd=REPO, env=env, capture_output=True,
        text=True, timeout=600, check=False,
    )  # fmt: skip


def test_venv_gpu_with_a_wheelhouse_reads_that_folder_and_nothing_else(tmp_path):
    """The target's steps install the stand-ins from the wheelhouse (1.0) although the index is
    dead, ``PIP_FIND_LINKS`` and a pip configuration file of the machine's offer 2.0 of each."""
    house, decoys = tmp_path / "wheelhouse", tmp_path / "decoys"
    house.mkdir(), decoys.mkdir()
    names = {"gpu_torch": (), "gpu_stack": ("gpu_torch",), "gpu_te": ("gpu_torch",)}
    for name, requires in names.items():
        make_wheel(house, name, "1.0", requires)
        make_wheel(decoys, name, "2.0", requires)
    (house / "PYTHON").write_text(f"{sys.version_info[0]}.{sys.version_info[1]}\n")
    make_wheel(house, "transformer_engine_torch", "2.9.0")  # prebuilt: no toolkit needed
    config = tmp_path / "pip.conf"
    config.write_text(f"[global]\nfind-links = {decoys}\nindex-url = http://127.0.0.1:9/simple\n")
    env = {**os.environ, "PIP_CONFIG_FILE": str(config), "PIP_FIND_LINKS": str(decoys),
           "PIP_INDEX_URL": "http://127.0.0.1:9/simple"}  # fmt: skip
    venv = tmp_path / "venv"
    done = run_make(
        ["venv-gpu", f"WHEELHOUSE={house}", f"GPU_VENV={venv}", f"PY={sys.executable}",
         "NO_GPU=1", "GPU_TORCH=gpu_torch", "GPU_STACK=gpu_stack", "GPU_TE=gpu_te",
         ("GPU_CHECK_NO_GPU=import gpu_torch, gpu_stack, gpu_te; "
          "assert gpu_torch.VERSION == gpu_stack.VERSION == gpu_te.VERSION == '1.0'")],
        env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (venv / ".installed").is_file()
    assert "prebuilt in the wheelhouse" in done.stdout and "no GPU check" in done.stdout


def test_every_install_step_of_the_real_target_has_no_index():
    """``make -n``: each pip line of ``venv-gpu WHEELHOUSE=...`` (torch, megarl and vLLM,
    Transformer Engine) reads the folder alone, with the machine's pip configuration off."""
    done = run_make(["-n", "-B", "venv-gpu", "WHEELHOUSE=/some/house"], dict(os.environ))
    pips = [line for line in done.stdout.splitlines() if "pip install" in line]
    assert len(pips) == 3, done.stdout
    for line in pips:
        assert "--no-index --find-links /some/house" in line and "PIP_CONFIG_FILE=/dev/null" in line
        assert "-u PIP_FIND_LINKS -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL" in line
    assert "torch" in pips[0] and "vllm" in pips[1] and "transformer-engine[pytorch" in pips[2]


def preflight(args: list[str], env: dict[str, str] | None = None):
    return subprocess.run(
        [sys.executable, str(PREFLIGHT), *args], capture_output=True, text=True, timeout=120,
        env=env or dict(os.environ), check=False,
    )  # fmt: skip


def one_line_refusal(done: subprocess.CompletedProcess) -> str:
    lines = done.stderr.splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("error: ") and "Traceback" not in done.stderr
    return lines[0]


def fake_toolkit(root: Path, release: str, cudnn: bool) -> dict[str, str]:
    """A ``CUDA_HOME`` whose ``nvcc -V`` says ``release``, with or without ``cudnn.h``."""
    (root / "bin").mkdir(parents=True)
    (root / "include").mkdir()
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.1'\n")
    nvcc.chmod(0o755)
    if cudnn:
        (root / "include" / "cudnn.h").write_text("/* cuDNN */\n")
    return {**os.environ, "CUDA_HOME": str(root), "CPATH": ""}


def test_each_toolkit_refusal_is_one_line(tmp_path):
    """Before the TE build: nvcc missing, nvcc 12.x, no cudnn.h; with both, it passes."""
    missing = {**os.environ, "CUDA_HOME": str(tmp_path / "none")}
    assert "nvcc not found" in one_line_refusal(preflight(["before", "--build-te"], missing))
    old = fake_toolkit(tmp_path / "cuda12", "12.4", cudnn=True)
    assert "release 12.4" in one_line_refusal(preflight(["before", "--build-te"], old))
    bare = fake_toolkit(tmp_path / "cuda13", "13.0", cudnn=False)
    assert "cudnn.h not found" in one_line_refusal(preflight(["before", "--build-te"], bare))
    good = fake_toolkit(tmp_path / "cuda13full", "13.0", cudnn=True)
    done = preflight(["before", "--build-te"], good)
    assert done.returncode == 0 and "toolkit ok" in done.stdout, done.stderr


def test_make_venv_gpu_stops_at_the_preflight_before_anything_is_made(tmp_path):
    env = {**os.environ, "CUDA_HOME": str(tmp_path / "none")}
    done = run_make(["venv-gpu", f"GPU_VENV={tmp_path / 'venv'}", f"PY={sys.executable}"], env)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode != 0 and len(errors) == 1 and "nvcc not found" in errors[0]
    assert not (tmp_path / "venv").exists()


def test_a_wheelhouse_for_another_python_is_one_line(tmp_path):
    (tmp_path / "PYTHON").write_text("3.12\n")
    mine = f"{sys.version_info[0]}.{sys.version_info[1]}"
    line = one_line_refusal(preflight(["before", "--wheelhouse", str(tmp_path)]))
    assert f"built for Python 3.12, this is Python {mine}" in line
    (tmp_path / "PYTHON").unlink()
    assert "no PYTHON file" in one_line_refusal(
        preflight(["before", "--wheelhouse", str(tmp_path)])
    )


@pytest.mark.parametrize(
    ("version", "refused"), [((3, 10, 12), True), ((3, 11, 7), False), ((3, 12, 3), False),
                             ((3, 15, 0), True)],
)  # fmt: skip
def test_python_versions_the_pins_allow(version, refused):
    problem = gpu_preflight.check_python(version)
    assert (problem is not None) == refused
    if refused:
        assert "\n" not in problem and ".".join(map(str, version)) in problem


def test_each_cuda_refusal_is_one_line():
    """A CPU wheel (this machine's torch, through the command), no driver, a driver too old for
    CUDA 13 (a 550 one), a driver new enough but no GPU visible; a GPU seen passes."""
    import torch

    if not torch.cuda.is_available():
        assert "is a CPU build" in one_line_refusal(preflight(["cuda"]))
    check = gpu_preflight.check_cuda
    lines = [
        check("2.13.0+cpu", None, False, None),
        check("2.13.0", "13.0", False, None),
        check("2.13.0", "13.0", False, "550.54.15"),
        check("2.13.0", "13.0", False, "580.65.06"),
    ]
    assert ["CPU build" in lines[0], "no NVIDIA driver" in lines[1], "too old" in lines[2],
            "sees no GPU although driver 580.65.06" in lines[3]] == [True] * 4  # fmt: skip
    assert all("\n" not in line for line in lines)
    assert check("2.13.0", "13.0", True, "580.65.06") is None
