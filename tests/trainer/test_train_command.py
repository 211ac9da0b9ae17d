"""Bad input to ``megarl train`` gets one line and exit 2 before any process is launched."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO

CONFIG = "configs/grpo_tiny_cpu.yaml"


@pytest.fixture
def tiny(tiny_overrides) -> list[str]:
    return tiny_overrides


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("data.train_files=/nonexistent/train.parquet", "/nonexistent/train.parquet"),
        (
            "data.max_prompt_length=4 data.filter_overlong_prompts=false data.truncation=error",
            "row",
        ),
        ("actor_rollout_ref.actor.ppo_mini_batch_size=3", "ppo_mini_batch_size"),
        ("reward_model.enable=true", "reward_model"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tiny, override, named):
    done = subprocess.run(
        [sys.executable, "-m", "megarl.cli", "train", "-c", CONFIG, *tiny, *override.split()],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert named in lines[0] and "Traceback" not in done.stderr
