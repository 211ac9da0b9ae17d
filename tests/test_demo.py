"""The conversion demo (`make demo-convert` = `python -m megarl.commands.demo`) runs end to end, also over
the outputs of an earlier run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.multirank
def test_demo_runs_over_an_earlier_runs_outputs(tmp_path):
    for leftover in ("tiny-qwen2-megatron", "tiny-qwen2-roundtrip"):  # as a previous run leaves
        (tmp_path / leftover).mkdir()
        (tmp_path / leftover / "stale.txt").write_text("from an earlier run")
    done = subprocess.run(
        [sys.executable, "-m", "megarl.commands.demo", "--out", str(tmp_path)],
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "bit-identical: True" in done.stdout
    assert "weight sync OK" in done.stdout
    assert not (tmp_path / "tiny-qwen2-megatron" / "stale.txt").exists()
    assert (tmp_path / "tiny-qwen2-roundtrip" / "config.json").exists()
