"""``megarl convert`` as a user runs it (its own process), for the conversion tests."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.conftest import left_behind

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
ENV.pop("RANK", None)
ENV.pop("WORLD_SIZE", None)


def run_convert(*args: str, script: str | None = None) -> subprocess.CompletedProcess:
    """``megarl convert ARGS`` (or ``tools/SCRIPT ARGS``) as a separate process, with a
    temporary directory of its own: what it left there is the result's ``left_behind``."""
    if script is None:
        cmd = [sys.executable, "-m", "megarl.cli", "convert", *args]
    else:
        cmd = [sys.executable, str(REPO / "tools" / script), *args]
    tmp = Path(tempfile.mkdtemp(prefix="megarl-convert-test-"))
    try:
        result = subprocess.run(
            cmd, check=False, env={**ENV, "TMPDIR": str(tmp)}, cwd=REPO, capture_output=True,
            text=True, timeout=900,
        )  # fmt: skip
        result.left_behind = left_behind(tmp)  # type: ignore[attr-defined]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return result


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """``result`` exited 0 and left nothing in its temporary directory."""
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    assert result.left_behind == [], result.left_behind  # type: ignore[attr-defined]
    return result
