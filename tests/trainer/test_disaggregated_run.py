"""``megarl train`` with vLLM on a rank of its own, one step off (issue 26): the quickstart on 2
training ranks plus 1 rollout rank (``actor_rollout_ref.rollout.nnodes=1``,
``n_gpus_per_node=1``, ``async_training.staleness_threshold=1``) learns the synthetic task, says
where its rollout runs, keeps the console megarl's own and leaves nothing in its temporary
directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._run_outputs import read_metrics
from tests.conftest import left_behind
from tests.trainer.test_grpo_learning import MEGARL_LINE

REPO = Path(__file__).resolve().parents[2]
STEPS = 10
pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.multirank]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("one_step_off")
    (out / "tmp").mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "megarl.commands.quickstart", "--out", str(out),
         "actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1",
         "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
         "async_training.staleness_threshold=1", f"trainer.total_training_steps={STEPS}",
         "trainer.test_freq=5", "trainer.save_freq=-1"],
        cwd=REPO, env={**os.environ, "TMPDIR": str(out / "tmp")}, capture_output=True,
        text=True, timeout=1200, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    run_dir = out / "runs" / "grpo_tiny_cpu"
    return {"done": done, "metrics": read_metrics(run_dir), "run_dir": run_dir, "tmp": out / "tmp"}


def test_one_step_off_learns(run):
    """Greedy validation rises as the colocated run's does (the dense learning test's bar: its
    lr-0 control shows greedy validation does not move by itself)."""
    m = run["metrics"]
    gain = m[STEPS]["val/score/mean"] - m[0]["val/score/mean"]
    print(f"r0={m[0]['val/score/mean']:.4f} final={m[STEPS]['val/score/mean']:.4f} gain={gain:.4f}")
    assert gain >= 0.15


def test_every_step_after_the_first_trains_on_a_rollout_one_update_old(run):
    m = run["metrics"]
    assert [m[s]["async/staleness"] for s in range(1, STEPS + 1)] == [0.0] + [1.0] * (STEPS - 1)
    assert m[1]["rollout/logprob_diff_max"] <= 1e-4  # step 1: the synced initial weights


def test_console_says_where_the_rollout_runs_and_holds_only_megarl_lines(run):
    done = run["done"]
    lines = [p.strip() for t in (done.stdout, done.stderr) for line in t.splitlines()
             for p in line.split("\r") if p.strip()]  # fmt: skip
    assert [line for line in lines if not MEGARL_LINE.match(line)] == []
    assert any("on 1 rank(s) of its own, one step off" in line for line in lines), lines[:3]
    assert (run["run_dir"] / "logs" / "rank2.log").is_file()  # the rollout rank's log


def test_the_run_leaves_nothing_in_the_temporary_directory(run):
    assert left_behind(run["tmp"]) == []
