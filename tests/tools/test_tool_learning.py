"""The tool demo learns: ``tools/run_tool_task.py`` (``make demo-tools``) from nothing, cut to 10
steps: the tool task and its warm-started tiny model made, then ``configs/grpo_tools_tiny_cpu.yaml``
through ``megarl train`` (2 ranks, actor TP 2, vLLM TP 2 colocated, multi-turn rollouts with the
calculator). Greedy validation with tools at steps 0 and 10.

σ of the lr-0 control is 0, measured once (docs/tools.md, "The tool task"): at lr 0 the weights
do not move and greedy decoding is deterministic (the warm-started model's greedy answer is a
guess, which earns 0), so three evaluations (steps 0, 5, 10 of ``run_tool_task.py
actor_rollout_ref.actor.optim.lr=0 trainer.total_training_steps=10 trainer.test_freq=5``) gave
0.000 each. The bar is then the issue's floor, 0.15.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._run_outputs import read_metrics

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.multirank]

SIGMA_LR0 = 0.0
"""σ of greedy validation in the lr-0 control (measured; see the module's docstring)."""
SOURCE = "reward/megarl/tool_mul"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("tool_demo")
    (out / "tmp").mkdir()
    proc = subprocess.run(
        [sys.executable, "tools/run_tool_task.py", "--out", str(out),
         "trainer.total_training_steps=10", "trainer.test_freq=10"],
        cwd=REPO, env={**os.environ, "TMPDIR": str(out / "tmp")},
        capture_output=True, text=True, timeout=1200, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return read_metrics(out / "runs" / "grpo_tools_tiny_cpu"), proc.stdout


def test_validation_with_tools_rises_past_the_bar(run):
    metrics, stdout = run
    before, after = metrics[0]["val/score/mean"], metrics[10]["val/score/mean"]
    print(f"validation {before:.3f} -> {after:.3f}")
    print(*(line for line in stdout.splitlines() if "warm start" in line))
    assert after - before >= max(0.15, 3 * SIGMA_LR0)
    assert "megarl: warm start" in stdout  # the model was made and warm-started here


def test_the_model_calls_the_tool_more_and_more_often_successfully(run):
    """From real vLLM through the tiny chat template: hermes calls the parser reads (few
    errors), on more and more trajectories, and more and more of them with the exact product
    (``tool_ok``: the calculator answered the question asked)."""
    metrics, _ = run

    def mean(key: str, steps: range) -> float:
        return sum(metrics[s][key] for s in steps) / len(steps)

    early, late = range(1, 4), range(8, 11)
    assert 0.2 <= mean("multi_turn/tool_calls/mean", early) <= 0.8  # the warm start: 3 in 8
    assert mean("multi_turn/tool_calls/mean", late) >= 0.9
    assert mean("multi_turn/tool_success_rate", early) >= 0.8  # the format is there at once
    ok_early, ok_late = mean(f"{SOURCE}/tool_ok/mean", early), mean(f"{SOURCE}/tool_ok/mean", late)
    digits = mean(f"{SOURCE}/digits/mean", early), mean(f"{SOURCE}/digits/mean", late)
    print(f"successful calls per trajectory {ok_early:.3f} -> {ok_late:.3f}, "
          f"final answer's digits {digits[0]:.3f} -> {digits[1]:.3f}")  # fmt: skip
    assert ok_late - ok_early >= 0.2
