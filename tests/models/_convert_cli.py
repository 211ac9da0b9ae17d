"""``megarl convert`` as a user runs it (its own process), for the conversion tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
ENV.pop("RANK", None)
ENV.pop("WORLD_SIZE", None)


def run_convert(*args: str, script: str | None = None) -> subprocess.CompletedProcess:
    """``megarl convert ARGS`` (or ``tools/SCRIPT ARGS``) as a separate process."""
    if script is None:
        cmd = [sys.executable, "-m", "megarl.cli", "convert", *args]
    else:
        cmd = [sys.executable, str(REPO / "tools" / script), *args]
    return subprocess.run(
        cmd, check=False, env=ENV, cwd=REPO, capture_output=True, text=True, timeout=900
    )


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result
