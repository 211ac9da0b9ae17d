"""``launch/torchrun_local.sh`` with a stand-in trainer module, and ``megarl tracking run-dir``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.multirank

ENV = {
    **os.environ,
    "PYTHONPATH": str(REPO),
    "OMP_NUM_THREADS": "1",
    "MEGARL_PYTHON": sys.executable,
}


@pytest.fixture
def tiny(tiny_overrides, tmp_path) -> list[str]:
    return [*tiny_overrides, f"trainer.default_local_dir={tmp_path / 'run'}"]


def emulate_gpus(directory, count: int) -> str:
    """A ``PATH`` whose ``nvidia-smi -L`` lists ``count`` GPUs, as on an 8-GPU node."""
    smi = directory / "nvidia-smi"
    lines = "".join(
        f"echo 'GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i})'\n" for i in range(count)
    )
    smi.write_text(f"#!/bin/sh\n{lines}")
    smi.chmod(0o755)
    return f"{directory}{os.pathsep}{os.environ['PATH']}"


def test_torchrun_local_passes_config_and_overrides_to_2_ranks(tiny, tmp_path):
    """Through ``megarl train`` (its pre-flight passes: real tiny files) to torchrun's ranks; a
    node of 8 GPUs (emulated ``nvidia-smi``) with ``CUDA_VISIBLE_DEVICES=5,7`` starts 2 ranks,
    one per GPU torch sees (not 8 sharing them)."""
    env = {**ENV, "MEGARL_TRAIN_MODULE": "tests.launch._gloo_payload",
           "PATH": emulate_gpus(tmp_path, 8), "CUDA_VISIBLE_DEVICES": "5,7"}  # fmt: skip
    done = subprocess.run(
        ["launch/torchrun_local.sh", "configs/grpo_tiny_cpu.yaml", *tiny, "trainer.seed=7"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    args = f"--config configs/grpo_tiny_cpu.yaml {' '.join(tiny)} trainer.seed=7 trainer.nnodes=1 "
    args += "trainer.n_gpus_per_node=2"
    for rank in (0, 1):
        assert f"rank {rank} of 2: sum 3, args {args}" in done.stdout
        # Megatron's TP/SP overlap relies on it; megarl train sets it for every rank.
        assert f"rank {rank} CUDA_DEVICE_MAX_CONNECTIONS=1" in done.stdout


def test_torchrun_local_checks_before_launching():
    """The pre-flight of ``megarl train``: one line, exit 2, nothing launched (issue 23)."""
    done = subprocess.run(
        ["launch/torchrun_local.sh", "configs/grpo_tiny_cpu.yaml", "data.train_files=/no/t.parquet"],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-3000:]
    assert "/no/t.parquet" in lines[0] and "Traceback" not in done.stderr


def test_run_dir_command_resolves_the_config(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "megarl.commands.tracking", "run-dir", "--config",
         "configs/ppo_tiny_cpu.yaml", "trainer.experiment_name=x${trainer.seed}"],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{REPO}/outputs/checkpoints/x42\n"
