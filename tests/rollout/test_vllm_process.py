"""The IPC directory each rank gives vLLM (:mod:`megarl.rollout.vllm_process`)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from megarl.rollout import vllm_process


def _private_directory(monkeypatch, tmpdir: Path) -> str:
    monkeypatch.setenv("TMPDIR", str(tmpdir))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    # Set, then deleted: monkeypatch then restores "unset" afterwards (a bare delenv of an unset
    # variable records nothing, and the path set below leaked into every later vLLM launch).
    monkeypatch.setenv(vllm_process.IPC_ENV, "unset")
    monkeypatch.delenv(vllm_process.IPC_ENV)
    vllm_process._private_ipc_directory()
    path = os.environ[vllm_process.IPC_ENV]
    assert Path(path).is_dir()
    shutil.rmtree(path)
    return path


def test_the_ipc_directory_is_private_and_in_the_temporary_directory(monkeypatch):
    short = Path(tempfile.mkdtemp(dir="/tmp"))  # pytest's own tmp_path is too deep already
    try:
        path = _private_directory(monkeypatch, short)
    finally:
        shutil.rmtree(short)
    assert Path(path).parent == short


def test_a_deep_temporary_directory_still_gives_socket_paths_that_fit(tmp_path, monkeypatch):
    """Under a deep TMPDIR (a launch's inside a test's, measured: 131 bytes per socket path)
    vLLM's bind failed: 'ipc path ... is longer than 107 characters'."""
    deep = tmp_path / ("d" * 70)
    deep.mkdir()
    path = _private_directory(monkeypatch, deep)
    assert len(path) + vllm_process.SOCKET_NAME_LEN <= vllm_process.SOCKET_PATH_MAX
    assert Path(path).parent == Path("/tmp")


def test_a_directory_the_user_set_is_kept(monkeypatch):
    monkeypatch.setenv(vllm_process.IPC_ENV, "/run/mine")
    vllm_process._private_ipc_directory()
    assert os.environ[vllm_process.IPC_ENV] == "/run/mine"
